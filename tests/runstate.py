"""Putting a run into a real database for the metrics tests, through the real writers.

Steps arrive through the real ingest code (payloads built by the agent's own code, then
validated by the collector's schema). :func:`fill_breakdown` gives a stored window the
profiler breakdown through the collector's profile writer
(:func:`stepwatch_server.ingest.profiles.store`: running means, and wait vs
transfer split from the ranks' arrival times); flags are written by the analysis worker's
writer (:func:`stepwatch_server.worker.outputs.write_findings`), from findings of the real
detector (:func:`detect_stragglers`) or built where a test needs exact numbers
(:func:`open_straggler`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timezone

from sqlalchemy import Engine, select

from stepwatch_server.analysis import types as analysis
from stepwatch_server.analysis.pipeline import Change
from stepwatch_server.analysis.stragglers import StragglerDetector
from stepwatch_server.ingest import profiles
from stepwatch_server.ingest.store import Ingestor
from stepwatch_server.schemas.ingest import IngestPayload
from stepwatch_server.storage.backend import open_storage
from stepwatch_server.storage.models import Rank, RankWindow, Run
from stepwatch_server.worker.outputs import write_findings

from .payloads import payload, profile_entry


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
    profiled: bool = False,
) -> None:
    """One batch of ``steps`` steps from each rank, starting at step ``first``;
    ``profiled``: as an agent with a profiler sends it, saying it owes no profiler entry
    through its last step (``steps.profiles_through``)."""
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
            profiles_through=first + steps - 1 if profiled else None,
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
    """Store a two-step profiler window of every rank into a stored window (default: the
    newest window all ranks have) with the collector's profile writer; returns the window.

    ``comm_wait(rank)`` sets when each rank enters the window's all-reduces: the rank with
    the smallest value arrives last and waits 0, every other rank waits the difference (as
    the collector derives it). Transfer is 10 ms.
    """
    rid = run_id(engine, run)
    t = RankWindow.__table__
    storage = open_storage(engine)
    with engine.begin() as conn:
        world, window_steps = conn.execute(
            select(Run.world_size, Run.window_steps).where(Run.id == rid)
        ).one()
        rows = conn.execute(select(t.c.rank, t.c.window, t.c.first_step).where(t.c.run_id == rid)).all()
        if window is None:
            ranks = {r for r, _, _ in rows}
            have = {(r, w) for r, w, _ in rows}
            window = max(w for w in {w for _, w, _ in rows} if all((r, w) in have for r in ranks))
        firsts = {r: f for r, w, f in rows if w == window}
        last_in = min(comm_wait(r) for r in firsts)
        for rank, first in sorted(firsts.items()):
            wait = comm_wait(rank) - last_in
            step_s = compute(rank) + overlapped + exposed + idle
            entry = profile_entry(
                first_step=first,
                enter=[0.2 - wait + 10.0 * j for j in range(2)],  # one period for all ranks
                end=[0.21 + 10.0 * j for j in range(2)],
                compute=compute(rank),
                overlapped=overlapped,
                exposed=exposed,
                data_wait=0.0,
                step_s=step_s,
                ranks=None,
            )
            entry["arrivals"][0]["size"] = world
            body = payload(run=run, rank=rank, world=world, first=first, times=[step_s] * 2, profiles=[entry])
            p = IngestPayload.model_validate(body)
            profiles.store(conn, storage, rid, window_steps, world, p)
    return window


def open_straggler(
    engine: Engine,
    run: str,
    *,
    rank: int,
    host: str,
    cost_seconds: float,
    cost_ratio: float,
    cause: analysis.Cause = "compute",
    first_step: int = 1,
) -> None:
    """An open straggler flag with exact numbers, written by the worker's writer."""
    store_finding(
        engine,
        analysis.Finding(
            kind="straggler",
            run=run,
            key=f"straggler:{cause}:rank={rank}",
            cause=cause,
            ranks=(rank,),
            hosts=(host,),
            first_step=first_step,
            last_step=first_step,
            status="open",
            evidence={"ratio": 1.5},
            cost_seconds=cost_seconds,
            cost_ratio=cost_ratio,
            message=f"Rank {rank} on {host} computes longer than its peers.",
        ),
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
        store_finding(engine, f, window)
    return findings


def store_finding(engine: Engine, f: analysis.Finding, window: int = 0) -> None:
    """Upsert one flag as the analysis worker does (:func:`write_findings`)."""
    rid = run_id(engine, f.run)
    with engine.begin() as conn:
        write_findings(conn, rid, [Change(f, window)], [], datetime.now(timezone.utc))
