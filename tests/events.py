"""Insert an event row the way the analysis would store one.

Used by the view tests (terminal and web page) to show a straggler flag while the
straggler detection that writes events is not on this branch: the row has every field
the events API serves, so the views are tested against the real read path.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import insert, select

from stepwatch_server.storage.engine import make_engine
from stepwatch_server.storage.models import Event, Run


def insert_event(
    db_url: str,
    run: str,
    *,
    first_step: int,
    last_step: int,
    ranks: Sequence[int] = (2,),
    hosts: Sequence[str] = ("node0",),
    kind: str = "straggler",
    cause: str | None = "compute",
    status: str = "open",
    cost_seconds: float = 0.05,
    cost_ratio: float = 0.25,
    message: str | None = None,
    evidence: dict[str, Any] | None = None,
) -> None:
    engine = make_engine(db_url)
    now = datetime.fromtimestamp(time.time(), tz=timezone.utc)
    try:
        with engine.begin() as conn:
            run_id = conn.execute(select(Run.__table__.c.id).where(Run.__table__.c.name == run)).scalar_one()
            conn.execute(
                insert(Event.__table__).values(
                    run_id=run_id,
                    key=f"{kind}:{cause}:rank={','.join(map(str, ranks))}",
                    kind=kind,
                    cause=cause,
                    ranks=list(ranks),
                    hosts=list(hosts),
                    first_step=first_step,
                    last_step=last_step,
                    status=status,
                    evidence=evidence or {},
                    cost_seconds=cost_seconds,
                    cost_ratio=cost_ratio,
                    message=message
                    or f"rank {','.join(map(str, ranks))} is a {cause} straggler from step {first_step}",
                    opened_at=now,
                    updated_at=now,
                )
            )
    finally:
        engine.dispose()
