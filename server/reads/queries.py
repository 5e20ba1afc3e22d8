"""Read side: runs, overview, downsampled series and per-rank summaries.

Per-step job values are derived in SQL from the additive columns that ingest keeps:
step time is the mean over the ranks that reported the step, and global tokens are the
tokens of the reporting data-parallel replicas scaled to all replicas, so a step that
only some ranks have reported yet is still an unbiased estimate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Literal

from sqlalchemy import Connection, Float, Select, and_, case, cast, exists, func, or_, select
from sqlalchemy.sql.elements import ColumnElement

from stepwatch.flops import per_token_rate

from ..schemas import EventOut, RankSummary, RunOverview, RunSummary, Series, SeriesPoint, Stat
from ..storage.models import Event, JobStep, Rank, RankWindow, Run
from . import progress
from .profiles import BREAKDOWN_METRICS, rank_profiles, window_series

LATEST_STEPS = 10
JS = JobStep.__table__
RUNS = Run.__table__
RANKS = Rank.__table__
RW = RankWindow.__table__
EV = Event.__table__


class NotFoundError(LookupError):
    """The named run (or metric) does not exist."""


@dataclass(frozen=True)
class RunRow:
    id: int
    name: str
    world_size: int
    dp_size: int
    layout: dict[str, int]
    convention: dict[str, Any] | None
    window_steps: int

    @property
    def mfu_scale(self) -> float | None:
        """MFU per token/s: flops_per_token / (devices x peak). None if peak unknown."""
        return per_token_rate(self.convention, self.world_size)


def get_run(conn: Connection, name: str) -> RunRow:
    row = conn.execute(select(RUNS).where(RUNS.c.name == name)).first()
    if row is None:
        raise NotFoundError(f"run {name!r} not found")
    return RunRow(
        id=row.id,
        name=row.name,
        world_size=row.world_size,
        dp_size=row.dp_size,
        layout=row.layout,
        convention=row.convention,
        window_steps=row.window_steps,
    )


def _step_time() -> ColumnElement[Any]:
    return JS.c.step_time_sum / JS.c.ranks


def _tokens_est(run: RunRow) -> ColumnElement[Any]:
    return cast(JS.c.tokens, Float) * run.dp_size / JS.c.token_ranks


def _valid() -> ColumnElement[bool]:
    return and_(JS.c.token_ranks > 0, JS.c.step_time_sum > 0)


#: Runs listed per page by default, and at most.
RUNS_PAGE = 100
RUNS_PAGE_MAX = 1000
RunStatus = Literal["running", "finished"]


@dataclass(frozen=True)
class RunFilter:
    """Which runs a listing holds: ``status`` running (some rank has not sent its final
    batch) or finished (every rank has), a name ``prefix``, and ``since`` (Unix seconds:
    some rank reported at or after it)."""

    status: RunStatus | None = None
    prefix: str | None = None
    since: float | None = None

    def where(self) -> list[ColumnElement[bool]]:
        conds: list[ColumnElement[bool]] = []
        if self.prefix:
            # Not LIKE: SQLite's is case-insensitive, and "_" would need escaping.
            conds.append(func.substr(RUNS.c.name, 1, len(self.prefix)) == self.prefix)
        if self.since is not None:
            when = datetime.fromtimestamp(self.since, timezone.utc)
            conds.append(exists().where(RANKS.c.run_id == RUNS.c.id, RANKS.c.last_seen >= when))
        if self.status is not None:
            unfinished = exists().where(
                RANKS.c.run_id == RUNS.c.id,
                or_(RANKS.c.final_step.is_(None), RANKS.c.final_step < RANKS.c.last_step),
            )
            reporting = exists().where(RANKS.c.run_id == RUNS.c.id)
            finished = and_(reporting, ~unfinished)
            conds.append(finished if self.status == "finished" else ~finished)
        return conds


def list_runs(
    conn: Connection, *, limit: int = RUNS_PAGE, offset: int = 0, where: RunFilter | None = None
) -> tuple[list[RunSummary], int]:
    """One page of runs, newest first, and how many runs match in all.

    The page is cut from ``runs`` by its primary key before the ranks are aggregated, so a
    page costs O(page), not O(runs) (10,000 runs listed whole were 1 MB and 300 ms)."""
    conds = (where or RunFilter()).where()
    total = conn.execute(select(func.count()).select_from(RUNS).where(*conds)).scalar_one()
    page = (
        select(RUNS.c.id, RUNS.c.name, RUNS.c.world_size)
        .where(*conds)
        .order_by(RUNS.c.id.desc())
        .limit(limit)
        .offset(offset)
        .subquery()
    )
    agg = (
        select(
            RANKS.c.run_id,
            func.count().label("ranks"),
            func.max(RANKS.c.last_step).label("last_step"),
            func.max(RANKS.c.last_seen).label("last_seen"),
        )
        .where(RANKS.c.run_id.in_(select(page.c.id)))
        .group_by(RANKS.c.run_id)
        .subquery()
    )
    rows = conn.execute(
        select(page.c.name, page.c.world_size, agg.c.ranks, agg.c.last_step, agg.c.last_seen)
        .select_from(page.outerjoin(agg, agg.c.run_id == page.c.id))
        .order_by(page.c.id.desc())
    ).all()
    runs = [
        RunSummary(
            name=r.name,
            world_size=r.world_size,
            ranks_reporting=r.ranks or 0,
            last_step=r.last_step,
            last_seen=_unix(r.last_seen),
        )
        for r in rows
    ]
    return runs, int(total)


def _unix(value: Any) -> float | None:
    if value is None:
        return None
    if value.tzinfo is None:  # SQLite returns naive datetimes for timezone-aware columns
        value = value.replace(tzinfo=timezone.utc)
    return float(value.timestamp())


def overview(conn: Connection, name: str) -> RunOverview:
    run = get_run(conn, name)
    where_run = JS.c.run_id == run.id
    st, tok = _step_time(), _tokens_est(run)
    # One pass over the run's steps for the totals and the untagged (steady) means: at
    # 30 days of 10 s steps this scan is most of the overview's time.
    untagged = JS.c.tag == 0
    row = conn.execute(
        select(
            func.count(),
            func.min(JS.c.step),
            func.max(JS.c.step),
            func.coalesce(func.sum(tok), 0.0),
            # As floats: a sum of saturated BIGINTs must not overflow (SQLite's sum() raises).
            func.sum(cast(JS.c.tokens, Float)),
            func.sum(cast(JS.c.padded_tokens, Float)),
            func.sum(case((untagged, st))),
            func.count(case((untagged, 1))),
            func.sum(case((untagged, tok))),
            func.avg(case((untagged, JS.c.data_wait_max))),
        ).where(where_run, _valid())
    ).one()
    totals, steady = row[:6], row[6:]
    recent_q = (
        select(st.label("st"), tok.label("tok"), JS.c.data_wait_max.label("dw"))
        .where(where_run, _valid())
        .order_by(JS.c.step.desc())
        .limit(LATEST_STEPS)
        .subquery()
    )
    recent = conn.execute(
        select(func.sum(recent_q.c.st), func.count(), func.sum(recent_q.c.tok), func.avg(recent_q.c.dw))
    ).one()
    ranks_reporting = conn.execute(select(func.count()).where(RANKS.c.run_id == run.id)).scalar_one()

    def rate(tokens: float | None, seconds: float | None) -> float | None:
        return float(tokens) / float(seconds) if tokens is not None and seconds else None

    tps = Stat(latest=rate(recent[2], recent[0]), mean=rate(steady[2], steady[0]))
    scale = run.mfu_scale
    mfu = Stat(
        latest=tps.latest * scale if scale and tps.latest is not None else None,
        mean=tps.mean * scale if scale and tps.mean is not None else None,
    )
    padded_sum = totals[5]
    extra = progress.sections(conn, run.id, run.window_steps, float(totals[3]))
    return RunOverview(
        name=run.name,
        world_size=run.world_size,
        layout=run.layout,
        window_steps=run.window_steps,
        convention=run.convention,
        ranks_reporting=ranks_reporting,
        first_step=totals[1],
        last_step=totals[2],
        steps_stored=totals[0],
        tokens_total=round(totals[3]),
        step_time_s=Stat(
            latest=recent[0] / recent[1] if recent[1] else None,
            mean=steady[0] / steady[1] if steady[1] else None,
        ),
        tokens_per_s=tps,
        mfu=mfu,
        data_wait_s=Stat(latest=_f(recent[3]), mean=_f(steady[3])),
        padding_ratio=1.0 - float(totals[4]) / float(padded_sum) if padded_sum else None,
        plan=extra.plan,
        progress=extra.progress,
        analysis=extra.analysis,
    )


def _f(v: Any) -> float | None:
    return None if v is None else float(v)


#: Series metrics: name -> (unit, builder of the per-step SQL expression).
def _metric_expr(run: RunRow, metric: str) -> tuple[str, ColumnElement[Any]]:
    st = _step_time()
    if metric == "step_time_s":
        return "s", st
    if metric == "step_time_max_s":
        return "s", JS.c.step_time_max
    if metric == "data_wait_s":
        return "s", JS.c.data_wait_max
    if metric == "tokens_per_s":
        return "tokens/s", _tokens_est(run) / st
    if metric == "mfu":
        scale = run.mfu_scale
        if scale is None:
            raise NotFoundError(f"run {run.name!r} has no peak FLOP/s in its convention, so no MFU")
        return "ratio", _tokens_est(run) / st * scale
    if metric == "ranks_reporting":
        return "ranks", cast(JS.c.ranks, Float)
    raise NotFoundError(f"unknown metric {metric!r}; one of {', '.join(SERIES_METRICS)}")


SERIES_METRICS = (
    "step_time_s",
    "step_time_max_s",
    "tokens_per_s",
    "mfu",
    "data_wait_s",
    "ranks_reporting",
    *BREAKDOWN_METRICS,
)


def series(
    conn: Connection, name: str, metric: str, *, from_step: int | None, to_step: int | None, max_points: int
) -> Series:
    """Per-step metric downsampled into at most ``max_points`` buckets of equal step
    width, each with min, mean and max of the steps inside it (not of a sample)."""
    run = get_run(conn, name)
    if metric in BREAKDOWN_METRICS:  # per rank window, mean over ranks (profile_queries)
        return window_series(
            conn, run.id, name, metric, from_step=from_step, to_step=to_step, max_points=max_points
        )
    unit, value = _metric_expr(run, metric)
    cond = [JS.c.run_id == run.id, _valid()]
    if from_step is None or to_step is None:
        lo, hi = conn.execute(select(func.min(JS.c.step), func.max(JS.c.step)).where(*cond)).one()
        if lo is None:
            return Series(run=name, metric=metric, unit=unit, points=[])
        from_step = lo if from_step is None else from_step
        to_step = hi if to_step is None else to_step
    if to_step < from_step:
        return Series(run=name, metric=metric, unit=unit, points=[])
    width = max(1, math.ceil((to_step - from_step + 1) / max_points))
    bucket = ((JS.c.step - from_step) // width).label("bucket")
    q: Select[Any] = (
        select(
            bucket,
            func.min(JS.c.step),
            func.max(JS.c.step),
            func.count(),
            func.min(value),
            func.avg(value),
            func.max(value),
        )
        .where(*cond, JS.c.step >= from_step, JS.c.step <= to_step)
        .group_by(bucket)
        .order_by(bucket)
    )
    points = [
        SeriesPoint(step_from=r[1], step_to=r[2], count=r[3], min=_f(r[4]), mean=_f(r[5]), max=_f(r[6]))
        for r in conn.execute(q)
    ]
    return Series(run=name, metric=metric, unit=unit, points=points)


def ranks(conn: Connection, name: str, *, profile_windows: int = 1) -> list[RankSummary]:
    """Each rank's identity, its latest stored window, its newest profiler window and its
    collectives merged over the newest ``profile_windows`` profiled windows."""
    run = get_run(conn, name)
    profiles = rank_profiles(conn, run.id, profile_windows)
    # The latest window of each rank by a per-rank lookup on the primary key (run, rank,
    # window), not a GROUP BY over every window the run ever stored.
    latest = (
        select(func.max(RW.c.window))
        .where(RW.c.run_id == RANKS.c.run_id, RW.c.rank == RANKS.c.rank)
        .scalar_subquery()
    )
    win = RW.alias("win")
    rows = conn.execute(
        select(RANKS, win)
        .select_from(
            RANKS.outerjoin(
                win, and_(win.c.run_id == RANKS.c.run_id, win.c.rank == RANKS.c.rank, win.c.window == latest)
            )
        )
        .where(RANKS.c.run_id == run.id)
        .order_by(RANKS.c.rank)
    ).mappings()
    out = []
    for r in rows:
        n = r[win.c.n_steps]
        st_sum = r[win.c.step_time_sum]
        prof, skipped, colls = profiles.get(r[RANKS.c.rank], (None, None, []))
        out.append(
            RankSummary(
                rank=r[RANKS.c.rank],
                host=r[RANKS.c.host],
                local_rank=r[RANKS.c.local_rank],
                coords=r[RANKS.c.coords],
                last_step=r[RANKS.c.last_step],
                last_seen=_unix(r[RANKS.c.last_seen]) or 0.0,
                clock=r[RANKS.c.clock],
                dropped_windows=r[RANKS.c.dropped_windows],
                dropped_steps=r[RANKS.c.dropped_steps],
                hot_path_mean_s=r[RANKS.c.hot_path_mean_s],
                window=r[win.c.window],
                window_first_step=r[win.c.first_step],
                window_last_step=r[win.c.last_step],
                step_time_s=st_sum / n if n else None,
                step_time_max_s=r[win.c.step_time_max],
                data_wait_s=r[win.c.data_wait_sum] / n if n else None,
                tokens_per_s=r[win.c.tokens_sum] / st_sum if n and st_sum else None,
                profile=prof,
                profile_skipped=skipped,
                collectives=colls,
            )
        )
    return out


def events(
    conn: Connection, name: str, *, status: str | None = None, kind: str | None = None
) -> list[EventOut]:
    """Flags of a run, newest first."""
    run = get_run(conn, name)
    q = select(EV).where(EV.c.run_id == run.id)
    if status is not None:
        q = q.where(EV.c.status == status)
    if kind is not None:
        q = q.where(EV.c.kind == kind)
    rows = conn.execute(q.order_by(EV.c.first_step.desc(), EV.c.id.desc())).mappings()
    return [
        EventOut(
            id=r["id"],
            key=r["key"],
            kind=r["kind"],
            cause=r["cause"],
            ranks=r["ranks"],
            hosts=r["hosts"],
            first_step=r["first_step"],
            last_step=r["last_step"],
            status=r["status"],
            evidence=r["evidence"],
            cost_seconds=r["cost_seconds"],
            cost_ratio=r["cost_ratio"],
            message=r["message"],
            opened_at=_unix(r["opened_at"]) or 0.0,
            updated_at=_unix(r["updated_at"]) or 0.0,
        )
        for r in rows
    ]
