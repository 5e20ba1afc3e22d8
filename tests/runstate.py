"""Putting a run into a real database for the metrics tests.

Steps arrive through the real ingest code (payloads built by the agent's own code, then
validated by the collector's schema). Two things are written directly, because their
producers live in other work streams: the profiler breakdown columns of
``rank_windows`` (the profiler window fills them) and open straggler rows in ``events``
(the straggler detector writes them). The rows have the shape those writers use.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timezone

from sqlalchemy import Engine, select, update

from stepwatch_server.db.models import Event, RankWindow, Run
from stepwatch_server.ingest import Ingestor
from stepwatch_server.schemas import IngestPayload

from .payloads import payload


def store(ingestor: Ingestor, **kwargs: object) -> None:
    assert ingestor.store(IngestPayload.model_validate(payload(**kwargs)))  # type: ignore[arg-type]


def feed(
    ingestor: Ingestor,
    *,
    run: str,
    world: int,
    first: int,
    steps: int,
    step_time: Callable[[int], float] = lambda rank: 0.5,
    wait: Callable[[int], float] = lambda rank: 0.0,
    tags: Sequence[str | None] | None = None,
    ranks: Iterable[int] | None = None,
    tokens: int = 1000,
    padded: int | None = None,
) -> None:
    """One batch of ``steps`` steps from each rank, starting at step ``first``."""
    for rank in ranks if ranks is not None else range(world):
        store(
            ingestor,
            run=run,
            rank=rank,
            world=world,
            first=first,
            times=[step_time(rank)] * steps,
            waits=[wait(rank)] * steps,
            tokens=[tokens] * steps,
            padded=[padded] * steps if padded is not None else None,
            tags=tags,
        )


def run_id(engine: Engine, name: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(Run.id).where(Run.name == name)).scalar_one())


def fill_breakdown(
    engine: Engine,
    run: str,
    *,
    compute: Callable[[int], float],
    comm_wait: Callable[[int], float],
    overlapped: float = 0.10,
    exposed: float = 0.05,
    idle: float = 0.02,
    window: int | None = None,
) -> int:
    """Write a profiler breakdown into a window of every rank (default: the newest window
    all ranks have); returns the window. Stand-in for the profiler window's ingest."""
    rid = run_id(engine, run)
    t = RankWindow.__table__
    with engine.begin() as conn:
        if window is None:
            rows = conn.execute(select(t.c.rank, t.c.window).where(t.c.run_id == rid)).all()
            ranks = {r for r, _ in rows}
            window = max(w for w in {w for _, w in rows} if all((r, w) in set(rows) for r in ranks))
        for (rank,) in conn.execute(select(t.c.rank).where(t.c.run_id == rid, t.c.window == window)).all():
            conn.execute(
                update(t)
                .where(t.c.run_id == rid, t.c.rank == rank, t.c.window == window)
                .values(
                    profiled_steps=2,
                    compute_s=compute(rank),
                    comm_overlapped_s=overlapped,
                    comm_exposed_s=exposed,
                    idle_s=idle,
                    comm_wait_s=comm_wait(rank),
                    comm_transfer_s=0.01,
                )
            )
    return window


def open_straggler(
    engine: Engine,
    run: str,
    *,
    rank: int,
    host: str,
    cost_seconds: float,
    cost_ratio: float,
    cause: str = "compute",
    first_step: int = 1,
) -> None:
    """An open straggler flag as the detector writes it. Stand-in for the detector."""
    now = datetime.now(timezone.utc)
    with engine.begin() as conn:
        conn.execute(
            Event.__table__.insert().values(
                run_id=run_id(engine, run),
                key=f"straggler:{cause}:rank={rank}",
                kind="straggler",
                cause=cause,
                ranks=[rank],
                hosts=[host],
                first_step=first_step,
                last_step=first_step,
                status="open",
                evidence={"ratio": 1.5},
                cost_seconds=cost_seconds,
                cost_ratio=cost_ratio,
                message=f"Rank {rank} on {host} computes longer than its peers.",
                opened_at=now,
                updated_at=now,
            )
        )
