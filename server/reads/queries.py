"""Read side: runs, overview, downsampled series and per-rank summaries.

Per-step job values are derived in SQL from the additive columns that ingest keeps:
step time is the mean over the ranks that reported the step, and global tokens are the
tokens of the reporting data-parallel replicas scaled to all replicas, so a step that
only some ranks have reported yet is still an unbiased estimate.

Why one module of more than 400 lines: every read here derives the same per-step
values (from ``storage/rollups.py``'s definitions) and must agree with the others
(the overview's totals are the series' points summed); keeping them together keeps one
definition in view.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Literal

from sqlalchemy import (
    Connection,
    Float,
    Integer,
    Text,
    and_,
    case,
    cast,
    exists,
    func,
    literal,
    literal_column,
    select,
    true,
)
from sqlalchemy.sql.elements import ColumnElement

from ..errors import NotFoundError
from ..schemas.responses import (
    CollectiveOut,
    EventOut,
    ProfileOut,
    RankSummary,
    RunOverview,
    RunSummary,
    Series,
    SeriesPoint,
    Stat,
)
from ..storage import rollups
from ..storage.backend import is_postgres
from ..storage.columns import JOB_STEP_BUCKETS, aggregate
from ..storage.models import Event, JobStep, JobStepBucket, Rank, RankWindow, Run, unix
from . import progress
from .buckets import buckets
from .profiles import BREAKDOWN_METRICS, rank_profiles, window_series
from .runs import RunInfo, get_run
from .status import DEFAULT_RULE, RunState, RunStatus, StatusRule, finished_run, hung_run, run_states
from .utilization import mfu_unavailable

LATEST_STEPS = 10
JS = JobStep.__table__
RUNS = Run.__table__
RANKS = Rank.__table__
RW = RankWindow.__table__
EV = Event.__table__
JB = JobStepBucket.__table__


class NoSeriesError(Exception):
    """The metric exists but this run cannot have it; the message says why."""


def _step_time() -> ColumnElement[Any]:
    return rollups.step_time()


def _tokens_est(run: RunInfo) -> ColumnElement[Any]:
    return rollups.tokens_est(run.dp_size)


def _valid() -> ColumnElement[bool]:
    return rollups.usable()


#: Runs listed per page by default, and at most.
RUNS_PAGE = 100
RUNS_PAGE_MAX = 1000
#: What ``GET /runs?status=`` accepts: every status the API shows, and ``running`` (not
#: finished: live, stalled or hung), the filter's only other value before it had them.
ListStatus = Literal[RunStatus, "running"]
#: The statuses decided by the time since a run's last step against the hang threshold
#: (``StatusRule``): no condition on stored columns, so :func:`list_runs` classifies the
#: runs with ``run_states``.
CLASSIFIED: tuple[ListStatus, ...] = ("live", "stalled")


@dataclass(frozen=True)
class RunFilter:
    """Which runs a listing holds: ``status`` (as ``run_states`` gives it, or ``running``:
    not finished), a name ``prefix``, and ``since`` (Unix seconds: some rank reported at
    or after it)."""

    status: ListStatus | None = None
    prefix: str | None = None
    since: float | None = None

    def where(self) -> list[ColumnElement[bool]]:
        """The conditions on ``runs``; a status in :data:`CLASSIFIED` has none (``list_runs``
        classifies the runs the other conditions keep)."""
        conds: list[ColumnElement[bool]] = []
        if self.prefix:
            # Not LIKE: SQLite's is case-insensitive, and "_" would need escaping.
            conds.append(func.substr(RUNS.c.name, 1, len(self.prefix)) == self.prefix)
        if self.since is not None:
            when = datetime.fromtimestamp(self.since, timezone.utc)
            conds.append(exists().where(RANKS.c.run_id == RUNS.c.id, RANKS.c.last_seen >= when))
        if self.status == "finished":
            conds.append(finished_run())
        elif self.status in ("running", "hung"):  # finished takes precedence over the others
            conds.append(~finished_run())
            if self.status == "hung":
                conds.append(hung_run())
        return conds


def list_runs(
    conn: Connection,
    *,
    limit: int = RUNS_PAGE,
    offset: int = 0,
    where: RunFilter | None = None,
    rule: StatusRule = DEFAULT_RULE,
) -> tuple[list[RunSummary], int]:
    """One page of runs, newest first, and how many runs match in all.

    The page is cut from ``runs`` by its primary key before the ranks are aggregated, so a
    page costs O(page), not O(runs) (10,000 runs listed whole were 1 MB and 300 ms);
    ``finished``, ``hung`` and ``running`` are conditions on ``runs`` and cost the same.

    ``live`` and ``stalled`` are not (the time since the last step against the hang
    threshold of the run's step time, ``StatusRule``): every run the other filters keep
    is classified by ``run_states`` (its two queries, over all of them) and the page is
    cut in Python from their ids. That costs O(runs matching the other filters), not
    O(page): at 10,000 runs, 80-100 ms a request on SQLite on a loaded 2-core machine and
    a p99 of 250-350 ms there on both backends, over the unfiltered list's 50 ms (``python
    -m benchmarks run_listing``'s ``live_p99_s``; ``run_states`` over every run is most of
    it, as in each ``/metrics`` scrape). The finished runs are not left out in SQL first:
    that was the same per-run aggregate run twice where none is finished (the benchmark);
    where most runs are finished, doing so (``~finished_run()`` in the query of ids) may
    pay."""
    f = where or RunFilter()
    conds = f.where()
    cols = (RUNS.c.id, RUNS.c.name, RUNS.c.world_size)
    states: dict[int, RunState] | None = None
    if f.status in CLASSIFIED:
        # One classification for the total, the page and the statuses shown: two passes
        # at two instants could list a run that became stalled in between as live.
        states = run_states(conn, select(RUNS.c.id).where(*conds) if conds else None, rule=rule)
        ids = sorted((i for i, s in states.items() if s.status == f.status), reverse=True)
        total = len(ids)
        page = select(*cols).where(RUNS.c.id.in_(ids[offset : offset + limit])).subquery()
    else:
        total = conn.execute(select(func.count()).select_from(RUNS).where(*conds)).scalar_one()
        page = select(*cols).where(*conds).order_by(RUNS.c.id.desc()).limit(limit).offset(offset).subquery()
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
        select(page.c.id, page.c.name, page.c.world_size, agg.c.ranks, agg.c.last_step, agg.c.last_seen)
        .select_from(page.outerjoin(agg, agg.c.run_id == page.c.id))
        .order_by(page.c.id.desc())
    ).all()
    if states is None:
        states = run_states(conn, [r.id for r in rows], rule=rule)
    runs = [
        RunSummary(
            name=r.name,
            world_size=r.world_size,
            ranks_reporting=r.ranks or 0,
            last_step=r.last_step,
            last_seen=states[r.id].last_seen,
            status=states[r.id].status,
        )
        for r in rows
    ]
    return runs, int(total)


def overview(conn: Connection, name: str, *, rule: StatusRule = DEFAULT_RULE) -> RunOverview:
    run = get_run(conn, name)
    state = run_states(conn, [run.id], rule=rule)[run.id]
    where_run = JS.c.run_id == run.id
    st, tok = _step_time(), _tokens_est(run)
    # Totals and the untagged (steady) means from the run's bucket rows (rollups.py):
    # one row per 64 steps, not a scan of every step.
    row = conn.execute(
        select(
            func.coalesce(func.sum(JB.c.n_steps), 0),
            func.min(JB.c.first_step),
            func.max(JB.c.last_step),
            func.coalesce(func.sum(JB.c.tokens_est), 0.0),
            func.sum(JB.c.tokens),
            func.sum(JB.c.padded_tokens),
            func.sum(JB.c.untagged_step_time),
            func.coalesce(func.sum(JB.c.untagged_steps), 0),
            func.sum(JB.c.untagged_tokens_est),
            func.sum(JB.c.untagged_data_wait),
        ).where(JB.c.run_id == run.id)
    ).one()
    # The untagged data wait as a mean; no untagged step: no steady means.
    row = (*row[:9], row[9] / row[7]) if row[7] else (*row[:6], None, 0, None, None)
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
    scale = run.mfu_per_token_rate
    mfu = Stat(
        latest=tps.latest * scale if scale and tps.latest is not None else None,
        mean=tps.mean * scale if scale and tps.mean is not None else None,
    )
    padded_sum = totals[5]
    extra = progress.sections(conn, run.id, run.window_steps, float(totals[3]))
    return RunOverview(
        name=run.name,
        world_size=run.world_size,
        layout=dict(run.layout),
        window_steps=run.window_steps,
        convention=None if run.convention is None else dict(run.convention),
        ranks_reporting=ranks_reporting,
        ranks_finished=state.ranks_finished,
        mfu_unavailable=mfu_unavailable(run.convention, run.world_size),
        status=state.status,
        last_seen=state.last_seen,
        first_step=totals[1],
        last_step=totals[2],
        steps_stored=totals[0],
        tokens_total=round(totals[3]),
        step_time_s=Stat(
            latest=recent[0] / recent[1] if recent[1] else None,
            mean=steady[0] / steady[1] if steady[1] and steady[0] is not None else None,
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


#: Series metrics: name -> (unit, the per-step value of ``rollups.VALUES``).
_SERIES: dict[str, tuple[str, str]] = {
    "step_time_s": ("s", "step_time"),
    "step_time_max_s": ("s", "slowest"),
    "data_wait_s": ("s", "data_wait"),
    "tokens_per_s": ("tokens/s", "tokens_per_s"),
    "mfu": ("ratio", "tokens_per_s"),
    "ranks_reporting": ("ranks", "ranks"),
}


def _metric(run: RunInfo, metric: str) -> tuple[str, str, float]:
    """Unit, per-step value and its scale (MFU is tokens/s times the run's MFU rate)."""
    if metric not in _SERIES:
        raise NotFoundError(f"unknown metric {metric!r}; one of {', '.join(SERIES_METRICS)}")
    unit, value = _SERIES[metric]
    scale = 1.0
    if metric == "mfu":
        rate = run.mfu_per_token_rate
        if rate is None:
            raise NoSeriesError(mfu_unavailable(run.convention, run.world_size) or "no MFU")
        scale = rate
    return unit, value, scale


SERIES_METRICS = (*_SERIES, *BREAKDOWN_METRICS)

B = rollups.BUCKET_STEPS


def _bucket_first(b: int) -> int:
    """First step of bucket ``b`` (bucket 0 also holds step 0, as window 0 does)."""
    return 0 if b == 0 else b * B + 1


def _step_range(conn: Connection, run_id: int) -> tuple[int | None, int | None]:
    """First and last usable step: the run's first and last bucket (primary-key probes)."""
    where = JB.c.run_id == run_id
    lo = conn.execute(select(JB.c.first_step).where(where).order_by(JB.c.bucket).limit(1)).scalar()
    hi = conn.execute(select(JB.c.last_step).where(where).order_by(JB.c.bucket.desc()).limit(1)).scalar()
    return lo, hi


def series(
    conn: Connection, name: str, metric: str, *, from_step: int | None, to_step: int | None, max_points: int
) -> Series:
    """Per-step metric downsampled into at most ``max_points`` buckets of equal step
    width, each with min, mean and max of the steps inside it (not of a sample).

    Points narrower than a stored bucket (``rollups.BUCKET_STEPS`` steps) are read from
    the steps, the others from the bucket rows plus the raw steps at the range's two
    ends: at most ``2 x BUCKET_STEPS`` steps and one row per bucket, whatever the run's
    length. Points at least a bucket wide are aligned to multiples of their width."""
    run = get_run(conn, name)
    if metric in BREAKDOWN_METRICS:  # per rank window, mean over ranks (profiles.py)
        return window_series(
            conn, run.id, name, metric, from_step=from_step, to_step=to_step, max_points=max_points
        )
    try:
        unit, value_name, scale = _metric(run, metric)
    except NoSeriesError as e:
        return Series(run=name, metric=metric, unit="ratio", points=[], reason=str(e))
    lo = hi = None
    if from_step is None or to_step is None:
        lo, hi = _step_range(conn, run.id)
    span = buckets(lo, hi, from_step, to_step, max_points)
    if span is None:
        return Series(run=name, metric=metric, unit=unit, points=[])
    from_step, to_step, width = span
    value = rollups.VALUES[value_name](run.dp_size)
    if width < B:
        group = (JS.c.step - from_step) // width
        parts = [_raw_points(conn, run.id, value, group, from_step, to_step)]
    else:
        n = to_step - from_step + 1
        wide = -(-n // (max_points - 1)) if max_points > 1 else n
        width = B * -(-wide // B)
        one = max_points == 1
        b_lo = 0 if from_step == 0 else max(1, -(-(from_step - 1) // B))
        b_hi = to_step // B - 1
        raw_group = literal(0) if one else (JS.c.step - 1) // width
        if b_lo > b_hi:
            parts = [_raw_points(conn, run.id, value, raw_group, from_step, to_step)]
        else:
            parts = [
                _raw_points(conn, run.id, value, raw_group, from_step, _bucket_first(b_lo) - 1),
                _bucket_points(
                    conn, run.id, value_name, literal(0) if one else (JB.c.bucket * B) // width, b_lo, b_hi
                ),
                _raw_points(conn, run.id, value, raw_group, (b_hi + 1) * B + 1, to_step),
            ]
    merged: dict[int, list[Any]] = {}
    for rows in parts:
        for g, first, last, count, total, low, high in rows:
            m = merged.get(g)
            if m is None:
                merged[g] = [first, last, count, total, low, high]
            else:
                m[0], m[1] = min(m[0], first), max(m[1], last)
                m[2] += count
                m[3] += total
                m[4], m[5] = min(m[4], low), max(m[5], high)
    points = [
        SeriesPoint(
            step_from=m[0],
            step_to=m[1],
            count=m[2],
            min=_f(m[4] * scale),
            mean=_f(m[3] / m[2] * scale),
            max=_f(m[5] * scale),
        )
        for _, m in sorted(merged.items())
    ]
    return Series(run=name, metric=metric, unit=unit, points=points)


Point = tuple[int, int, int, int, float, float, float]


def _raw_points(
    conn: Connection, run_id: int, value: ColumnElement[Any], group: ColumnElement[Any], lo: int, hi: int
) -> list[Point]:
    """(group, first step, last step, steps, sum, min, max) of the usable steps in [lo, hi]."""
    if hi < lo:
        return []
    g = group.label("g")
    q = (
        select(
            g,
            func.min(JS.c.step),
            func.max(JS.c.step),
            func.count(),
            func.sum(value),
            func.min(value),
            func.max(value),
        )
        .where(JS.c.run_id == run_id, _valid(), JS.c.step >= lo, JS.c.step <= hi)
        .group_by(g)
    )
    return [tuple(r) for r in conn.execute(q)]


def _bucket_points(
    conn: Connection, run_id: int, value: str, group: ColumnElement[Any], b_lo: int, b_hi: int
) -> list[Point]:
    """The same from the bucket rows ``b_lo..b_hi``, merged by the columns' rules."""
    g = group.label("g")
    t = JOB_STEP_BUCKETS
    cols = [
        JB.c.first_step,
        JB.c.last_step,
        JB.c.n_steps,
        *(JB.c[f"{value}_{p}"] for p in ("sum", "min", "max")),
    ]
    q = (
        select(g, *(aggregate(t.column(c.name).rule, c) for c in cols))
        .where(JB.c.run_id == run_id, JB.c.bucket >= b_lo, JB.c.bucket <= b_hi)
        .group_by(g)
    )
    return [tuple(r) for r in conn.execute(q)]


#: The fields of ``RankSummary`` in its order: the keys of each row :func:`rank_rows` builds.
_SUMMARY_FIELDS = tuple(RankSummary.model_fields)
#: The windows holding most ranks' newest window, read as index ranges (below).
COMMON_WINDOWS = 4


def rank_rows(conn: Connection, name: str, *, profile_windows: int = 1) -> list[dict[str, Any]]:
    """Each rank's identity, its latest stored window, its newest profiler window and its
    collectives merged over the newest ``profile_windows`` profiled windows: one dict per
    rank with ``RankSummary``'s fields in its order (the profile and collectives as their
    models), already of the fields' types, so that pydantic-core serialises the list as
    it would the models (``api/routes.py``; pinned by a test on both backends).

    Why dicts: at 4,096 ranks validating one ``RankSummary`` per rank cost more than the
    query, and reading each row's columns by name as much again; the rows come back in
    the response's order, their values already of the fields' types (the per-window
    means computed by the database, the same IEEE divisions as in Python), and the dicts
    are zipped from them with no per-value Python work.

    The latest window of a rank is the window of its last step (``last_step`` only grows,
    so no row lies past it). Nearly every rank is in one of a few windows (the newest,
    the one before), so those are read as ranges of the ``(run_id, window)`` index and
    hash-joined to the ranks: a probe of the primary key per rank was 35 of ~90 ms at
    4,096 ranks with 30 days stored, its descents touching five pages per rank. Ranks in
    no common window, or whose final batch moved ``last_step`` past their stored windows,
    are then probed for their newest window one by one."""
    run = get_run(conn, name)
    profiles = rank_profiles(conn, run.id, profile_windows)
    pg = is_postgres(conn)
    win = RW.alias("win")
    # Inline, so that the GROUP BY below is the selected expression itself.
    target = (RANKS.c.last_step - 1) // literal_column(str(int(run.window_steps)), Integer)
    common = (
        select(target)
        .where(RANKS.c.run_id == run.id)
        .group_by(target)
        .order_by(func.count().desc())
        .limit(COMMON_WINDOWS)
    )
    # last_seen as Unix seconds: PostgreSQL's exact epoch rounded once to a float, as
    # ``unix()`` rounds the same microseconds (parsing a timestamp per row cost ~5 ms).
    seen = cast(func.extract("epoch", RANKS.c.last_seen), Float) if pg else RANKS.c.last_seen
    n = win.c.n_steps
    # coords as its stored text, the texts parsed in one call below: one parse per row
    # by the driver cost a fifth of the request.
    coords_text = cast(RANKS.c.coords, Text)
    cols = (
        *(RANKS.c[c] for c in ("rank", "host", "local_rank")),
        coords_text,
        RANKS.c.last_step,
        seen,
        *(RANKS.c[c] for c in ("clock", "dropped_windows", "dropped_steps")),
        cast(RANKS.c.hot_path_mean_s, Float),
        win.c.window,
        win.c.first_step,
        win.c.last_step,
        case((n != 0, win.c.step_time_sum / cast(n, Float))),
        cast(win.c.step_time_max, Float),
        case((n != 0, win.c.data_wait_sum / cast(n, Float))),
        case((and_(n != 0, win.c.step_time_sum != 0), cast(win.c.tokens_sum, Float) / win.c.step_time_sum)),
    )

    # Positions in each row of the coords, of last_seen and of the window (None: none).
    i_coords, i_seen, i_window = (
        next(i for i, c in enumerate(cols) if c is col) for col in (coords_text, seen, win.c.window)
    )

    def query(cond: ColumnElement[bool], on: ColumnElement[bool]) -> Any:
        on = and_(win.c.run_id == RANKS.c.run_id, win.c.rank == RANKS.c.rank, on)
        return conn.execute(
            select(*cols)
            .select_from(RANKS.outerjoin(win, on))
            .where(RANKS.c.run_id == run.id, cond)
            .order_by(RANKS.c.rank)
        ).all()

    rows = query(true(), and_(win.c.window == target, win.c.window.in_(common)))
    missing = [r[0] for r in rows if r[i_window] is None]
    if missing:
        latest = (
            select(func.max(RW.c.window))
            .where(RW.c.run_id == RANKS.c.run_id, RW.c.rank == RANKS.c.rank)
            .scalar_subquery()
        )
        found = {r[0]: r for r in query(RANKS.c.rank.in_(missing), win.c.window == latest)}
        rows = [found.get(r[0], r) for r in rows]
    if not pg:  # SQLite returns the timestamp as a naive datetime
        rows = [(*r[:i_seen], unix(r[i_seen]) or 0.0, *r[i_seen + 1 :]) for r in rows]
    all_coords = json.loads("[" + ",".join(r[i_coords] for r in rows) + "]")
    no_profile: tuple[ProfileOut | None, str | None, list[CollectiveOut]] = (None, None, [])
    fields, get = _SUMMARY_FIELDS, profiles.get
    return [
        dict(zip(fields, (*r[:i_coords], coords, *r[i_coords + 1 :], *get(r[0], no_profile)), strict=True))
        for coords, r in zip(all_coords, rows, strict=True)
    ]


def ranks(conn: Connection, name: str, *, profile_windows: int = 1) -> list[RankSummary]:
    """:func:`rank_rows` as validated models (the run page's reader)."""
    return [RankSummary.model_validate(r) for r in rank_rows(conn, name, profile_windows=profile_windows)]


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
            opened_at=unix(r["opened_at"]) or 0.0,
            updated_at=unix(r["updated_at"]) or 0.0,
        )
        for r in rows
    ]
