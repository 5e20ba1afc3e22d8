"""A flag in a collector's database for the view tests, written by the analysis worker's
writer (:func:`stepwatch_server.worker.outputs.write_findings`), so the views are tested
against the rows the worker writes and the real read path. (Detection itself is tested
with the detectors and the worker; the browser test relies on it.)"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Engine

from stepwatch_server.analysis.types import Cause, Finding, Status
from stepwatch_server.storage.engine import make_engine

from .runstate import store_finding


def insert_event(
    db_url: str,
    run: str,
    *,
    first_step: int,
    last_step: int,
    ranks: Sequence[int] = (2,),
    hosts: Sequence[str] = ("node0",),
    cause: Cause = "compute",
    status: Status = "open",
    cost_seconds: float = 0.05,
    cost_ratio: float = 0.25,
) -> None:
    who = ",".join(map(str, ranks))
    finding = Finding(
        kind="straggler",
        run=run,
        key=f"straggler:{cause}:rank={who}",
        cause=cause,
        ranks=tuple(ranks),
        hosts=tuple(hosts),
        first_step=first_step,
        last_step=last_step,
        status=status,
        evidence={},
        cost_seconds=cost_seconds,
        cost_ratio=cost_ratio,
        message=f"rank {who} is a {cause} straggler from step {first_step}",
    )
    engine: Engine = make_engine(db_url)
    try:
        store_finding(engine, finding)
    finally:
        engine.dispose()
