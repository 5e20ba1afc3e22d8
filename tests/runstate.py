"""Putting a run into a real database for the metrics tests.

Steps arrive through the real ingest code (payloads built by the agent's own code, then
validated by the collector's schema). Two things are written directly, because their
producers live in other work streams: the profiler breakdown columns of
``rank_windows`` (the profiler window fills them) and rows in ``events`` (the collector's
detection wiring writes them). :func:`detect_stragglers` runs the real straggler detector
(``stepwatch_server.analysis``) over the stored windows and stores its findings the way
that wiring will; :func:`open_straggler` writes a flag by hand where a test needs exact
numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timezone

from sqlalchemy import Engine, select, update

from stepwatch_server.analysis import types as analysis
from stepwatch_server.analysis.stragglers import StragglerDetector
from stepwatch_server.ingest.store import Ingestor
from stepwatch_server.schemas.ingest import IngestPayload
from stepwatch_server.storage.models import Event, Rank, RankWindow, Run

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


def analysis_windows(engine: Engine, run: str, window: int) -> list[analysis.RankWindow]:
    """The stored windows of one index as the detector's input type (pure data parallel)."""
    rid = run_id(engine, run)
    rw, rk = RankWindow.__table__, Rank.__table__
    q = (
        select(rw, rk.c.host, rk.c.local_rank)
        .join(rk, (rk.c.run_id == rw.c.run_id) & (rk.c.rank == rw.c.rank))
        .where(rw.c.run_id == rid, rw.c.window == window)
    )
    with engine.connect() as conn:
        rows = conn.execute(q).mappings().all()
    return [
        analysis.RankWindow(
            run=run,
            rank=r["rank"],
            host=r["host"],
            local_rank=r["local_rank"],
            window=window,
            first_step=r["first_step"],
            last_step=r["last_step"],
            n_steps=r["n_steps"],
            step_time_s=r["step_time_sum"] / r["n_steps"],
            data_wait_s=r["data_wait_sum"] / r["n_steps"],
            compute_s=r["compute_s"],
            comm_exposed_s=r["comm_exposed_s"],
            comm_overlapped_s=r["comm_overlapped_s"],
            idle_s=r["idle_s"],
            comm_wait_s=r["comm_wait_s"],
            comm_transfer_s=r["comm_transfer_s"],
            dp_rank=r["rank"],
        )
        for r in rows
    ]


def detect_stragglers(engine: Engine, detector: StragglerDetector, window: int) -> list[analysis.Finding]:
    """Run the detector over one stored window and upsert what it opens or closes."""
    findings = detector.update(analysis_windows(engine, detector.run, window))
    for f in findings:
        store_finding(engine, f)
    return findings


def store_finding(engine: Engine, f: analysis.Finding) -> None:
    now = datetime.now(timezone.utc)
    t = Event.__table__
    rid = run_id(engine, f.run)
    values = {
        "kind": f.kind,
        "cause": f.cause,
        "ranks": list(f.ranks),
        "hosts": list(f.hosts),
        "last_step": f.last_step,
        "status": f.status,
        "evidence": dict(f.evidence),
        "cost_seconds": f.cost_seconds,
        "cost_ratio": f.cost_ratio,
        "message": f.message,
        "updated_at": now,
    }
    with engine.begin() as conn:
        where = (t.c.run_id == rid) & (t.c.key == f.key) & (t.c.first_step == f.first_step)
        if conn.execute(update(t).where(where).values(**values)).rowcount == 0:
            conn.execute(
                t.insert().values(run_id=rid, key=f.key, first_step=f.first_step, opened_at=now, **values)
            )
