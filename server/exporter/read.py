"""The bounded reads behind one scrape, each returning plain rows.

Every query is either an index probe per run (``max`` over a primary-key or index prefix)
or a range of a run's newest rows, so a scrape costs O(runs exported x ranks) whatever
the length of the runs' history. The one exception is the first token sum of a run after
the collector starts (see ``collector.py``), which reads the run's steps once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import Connection, Float, and_, cast, func, or_, select

from ..storage.models import Event, JobStep, Rank, RankWindow, Run, unix
from .state import EventRow, RankRow, StepRow

RUNS = Run.__table__
JS = JobStep.__table__
RW = RankWindow.__table__
EV = Event.__table__
RANKS = Rank.__table__


@dataclass(frozen=True, slots=True)
class RunHead:
    id: int
    name: str
    world_size: int
    dp_size: int
    window_steps: int
    convention: Mapping[str, Any] | None
    last_report_ts: float


@dataclass(frozen=True, slots=True)
class RunTail:
    last_step: int | None
    last_step_ts: float | None
    last_profiled_window: int | None


def reporting_runs(conn: Connection, *, since: float, limit: int) -> tuple[list[RunHead], int]:
    """The ``limit`` runs that reported most recently, if at or after ``since`` (collector
    clock, Unix s), newest first; and how many reported since then.

    Both read the index on ``runs.last_report_at``: the runs exported, whatever the number
    of runs stored (a probe of every run's batches took 0.8 s at 10,000 runs)."""
    cutoff = datetime.fromtimestamp(since, timezone.utc)
    recent = RUNS.c.last_report_at >= cutoff
    active = conn.execute(select(func.count()).select_from(RUNS).where(recent)).scalar_one()
    rows = conn.execute(
        select(
            RUNS.c.id,
            RUNS.c.name,
            RUNS.c.world_size,
            RUNS.c.dp_size,
            RUNS.c.window_steps,
            RUNS.c.convention,
            RUNS.c.last_report_at,
        )
        .where(recent)
        .order_by(RUNS.c.last_report_at.desc(), RUNS.c.name)
        .limit(limit)
    ).all()
    heads = [
        RunHead(
            id=r.id,
            name=r.name,
            world_size=r.world_size,
            dp_size=r.dp_size,
            window_steps=r.window_steps,
            convention=r.convention,
            last_report_ts=ts,
        )
        for r in rows
        if (ts := unix(r.last_report_at)) is not None
    ]
    return heads, int(active)


def tails(conn: Connection, ids: Iterable[int]) -> dict[int, RunTail]:
    """Newest step, its wall-clock end, and the newest profiled window, per run."""
    ids = list(ids)
    if not ids:
        return {}
    last_step = select(func.max(JS.c.step)).where(JS.c.run_id == RUNS.c.id).scalar_subquery()
    last_wall = (
        select(JS.c.wall_end)
        .where(JS.c.run_id == RUNS.c.id)
        .order_by(JS.c.step.desc())
        .limit(1)
        .scalar_subquery()
    )
    profiled = (
        select(func.max(RW.c.window))
        .where(RW.c.run_id == RUNS.c.id, RW.c.profiled_steps.is_not(None))
        .scalar_subquery()
    )
    rows = conn.execute(
        select(RUNS.c.id, last_step.label("s"), last_wall.label("w"), profiled.label("p")).where(
            RUNS.c.id.in_(ids)
        )
    ).all()
    return {r.id: RunTail(r.s, r.w, r.p) for r in rows}


def _step_row(r: Any) -> StepRow:
    return StepRow(
        step=r.step,
        ranks=r.ranks,
        token_ranks=r.token_ranks,
        step_time_sum=r.step_time_sum,
        data_wait_max=r.data_wait_max,
        tokens=r.tokens,
        padded_tokens=r.padded_tokens,
        tag=r.tag,
    )


_STEP_COLS = (
    JS.c.run_id,
    JS.c.step,
    JS.c.ranks,
    JS.c.token_ranks,
    JS.c.step_time_sum,
    JS.c.data_wait_max,
    JS.c.tokens,
    JS.c.padded_tokens,
    JS.c.tag,
)


def recent_steps(conn: Connection, after: Mapping[int, int]) -> dict[int, list[StepRow]]:
    """Job steps newer than ``after[run_id]``, per run (a primary-key range each)."""
    out: dict[int, list[StepRow]] = {run_id: [] for run_id in after}
    if not after:
        return out
    cond = or_(*(and_(JS.c.run_id == run_id, JS.c.step > step) for run_id, step in after.items()))
    for r in conn.execute(select(*_STEP_COLS).where(cond)):
        out[r.run_id].append(_step_row(r))
    return out


def first_untagged_steps(conn: Connection, run_id: int, limit: int) -> list[StepRow]:
    """The run's first ``limit`` untagged steps (its baseline after warm-up)."""
    q = select(*_STEP_COLS).where(JS.c.run_id == run_id, JS.c.tag == 0).order_by(JS.c.step).limit(limit)
    return [_step_row(r) for r in conn.execute(q)]


def token_sums(conn: Connection, spans: Mapping[int, tuple[int, int]]) -> dict[int, float]:
    """Estimated global tokens of the steps in ``(after, through]``, per run, given
    ``spans[run_id] = (after, through)`` (a primary-key range each)."""
    spans = {k: v for k, v in spans.items() if v[1] > v[0]}
    out = dict.fromkeys(spans, 0.0)
    if not spans:
        return out
    cond = or_(
        *(and_(JS.c.run_id == run_id, JS.c.step > a, JS.c.step <= b) for run_id, (a, b) in spans.items())
    )
    est = cast(JS.c.tokens, Float) * RUNS.c.dp_size / JS.c.token_ranks
    q = (
        select(JS.c.run_id, func.sum(est))
        .select_from(JS.join(RUNS, RUNS.c.id == JS.c.run_id))
        .where(cond, JS.c.token_ranks > 0)
        .group_by(JS.c.run_id)
    )
    for run_id, total in conn.execute(q):
        out[run_id] = float(total or 0.0)
    return out


def rank_rows(conn: Connection, windows: Mapping[int, Iterable[int]]) -> dict[int, list[RankRow]]:
    """Every rank's row of the given windows, per run (index ``(run_id, window)``)."""
    wanted = {run_id: sorted(set(ws)) for run_id, ws in windows.items()}
    out: dict[int, list[RankRow]] = {run_id: [] for run_id in wanted}
    wanted = {k: v for k, v in wanted.items() if v}
    if not wanted:
        return out
    cond = or_(*(and_(RW.c.run_id == run_id, RW.c.window.in_(ws)) for run_id, ws in wanted.items()))
    q = select(
        RW.c.run_id,
        RW.c.rank,
        RW.c.window,
        RW.c.n_steps,
        RW.c.step_time_sum,
        RW.c.data_wait_sum,
        RW.c.profiled_steps,
        RW.c.compute_s,
        RW.c.comm_overlapped_s,
        RW.c.comm_exposed_s,
        RW.c.idle_s,
        RW.c.comm_wait_s,
    ).where(cond)
    for r in conn.execute(q):
        out[r.run_id].append(
            RankRow(
                rank=r.rank,
                window=r.window,
                n_steps=r.n_steps,
                step_time_sum=r.step_time_sum,
                data_wait_sum=r.data_wait_sum,
                profiled_steps=r.profiled_steps,
                compute_s=r.compute_s,
                comm_overlapped_s=r.comm_overlapped_s,
                comm_exposed_s=r.comm_exposed_s,
                idle_s=r.idle_s,
                comm_wait_s=r.comm_wait_s,
            )
        )
    return out


def open_events(conn: Connection, ids: Iterable[int]) -> dict[int, list[EventRow]]:
    """Open events per run (index ``(run_id, status)``)."""
    ids = list(ids)
    out: dict[int, list[EventRow]] = {run_id: [] for run_id in ids}
    if not ids:
        return out
    q = select(
        EV.c.run_id,
        EV.c.kind,
        EV.c.cause,
        EV.c.ranks,
        EV.c.hosts,
        EV.c.first_step,
        EV.c.cost_seconds,
        EV.c.cost_ratio,
    ).where(EV.c.run_id.in_(ids), EV.c.status == "open")
    for r in conn.execute(q):
        out[r.run_id].append(
            EventRow(
                kind=r.kind,
                cause=r.cause,
                ranks=tuple(int(x) for x in (r.ranks or ())),
                hosts=tuple(str(x) for x in (r.hosts or ())),
                first_step=r.first_step,
                cost_seconds=r.cost_seconds,
                cost_ratio=r.cost_ratio,
            )
        )
    return out


def event_totals(conn: Connection, ids: Iterable[int]) -> dict[int, dict[str, int]]:
    """Events ever opened per run and kind."""
    ids = list(ids)
    out: dict[int, dict[str, int]] = {run_id: {} for run_id in ids}
    if not ids:
        return out
    q = (
        select(EV.c.run_id, EV.c.kind, func.count())
        .where(EV.c.run_id.in_(ids))
        .group_by(EV.c.run_id, EV.c.kind)
    )
    for run_id, kind, n in conn.execute(q):
        out[run_id][kind] = int(n)
    return out


def rank_identity(
    conn: Connection, wanted: Mapping[int, Iterable[int]]
) -> dict[tuple[int, int], tuple[str, int]]:
    """Host and local rank of the given ranks (primary-key probes)."""
    pairs = {run_id: sorted(set(ranks)) for run_id, ranks in wanted.items()}
    pairs = {k: v for k, v in pairs.items() if v}
    if not pairs:
        return {}
    cond = or_(*(and_(RANKS.c.run_id == run_id, RANKS.c.rank.in_(rs)) for run_id, rs in pairs.items()))
    q = select(RANKS.c.run_id, RANKS.c.rank, RANKS.c.host, RANKS.c.local_rank).where(cond)
    return {(r.run_id, r.rank): (r.host, r.local_rank) for r in conn.execute(q)}
