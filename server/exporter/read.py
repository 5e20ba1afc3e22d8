"""The bounded reads behind one scrape, each returning plain rows.

Every query is an index probe per run (``max`` over a primary-key or index prefix), a
range of a run's newest rows, or an aggregate over the rows of one or two windows of a
run, so a scrape costs O(runs exported) round trips whatever the length of the runs'
history, and returns O(runs x (top-K + quantiles)) rows whatever their rank count: the
quantiles across ranks, the slowest ranks and the breakdown means are computed by the
database (:func:`window_census`, :func:`profiled_summary`, :func:`order_statistics`),
and only the selected ranks' rows are fetched (:func:`rank_rows`). Fetching every rank's
rows of the newest windows into objects and sorting them in Python was 85% of a scrape at
16,384 ranks. The one exception is the first token sum of a run after the collector
starts (see ``collector.py``), which reads the run's steps once.

Three reads pass over one window's rows of every rank: the complete window's census
(quantiles and totals of step time and data wait), the newest profiled window's summary
and the status count over ``ranks``. The first two are made once per window by the
analysis worker (``summaries.py``), and a scrape reads what it stored while
:func:`window_signatures` (``window_steps`` rows of ``job_steps``) says no rank stored a
step of that window since; where none stands (the analysis off or behind, a step
stored since), the collector makes them itself and keeps the census between scrapes. The status
count remains (4.3 ms at 16,384 ranks in ``benchmarks/metrics_scrape.py``).

Why more than 400 lines: one bounded query per quantity a scrape exports, each with
its SQLite and PostgreSQL form; splitting them would separate queries that must stay
bounded the same way.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    ARRAY,
    Connection,
    Float,
    and_,
    case,
    cast,
    false,
    func,
    literal,
    or_,
    select,
    union_all,
)
from sqlalchemy.sql.elements import ColumnElement

from ..reads.runs import RunInfo, run_info
from ..storage.backend import is_postgres
from ..storage.columns import steps_of
from ..storage.models import Event, JobStep, Rank, RankWindow, Run
from .state import QUANTILES, RANK_QUANTITIES, EventRow, JobStepSums, RankWindowSums

RUNS = Run.__table__
JS = JobStep.__table__
RW = RankWindow.__table__
EV = Event.__table__
RANKS = Rank.__table__


@dataclass(frozen=True, slots=True)
class RunTail:
    last_step: int | None
    last_step_ts: float | None
    last_profiled_window: int | None


def reporting_runs(conn: Connection, *, since: float, limit: int) -> tuple[list[RunInfo], int]:
    """The ``limit`` runs that reported most recently, if at or after ``since`` (collector
    clock, Unix s), newest first; and how many reported since then.

    Both read the index on ``runs.last_report_at``: the runs exported, whatever the number
    of runs stored (a probe of every run's batches took 0.8 s at 10,000 runs)."""
    cutoff = datetime.fromtimestamp(since, timezone.utc)
    recent = RUNS.c.last_report_at >= cutoff
    active = conn.execute(select(func.count()).select_from(RUNS).where(recent)).scalar_one()
    rows = conn.execute(
        select(RUNS).where(recent).order_by(RUNS.c.last_report_at.desc(), RUNS.c.name).limit(limit)
    ).all()
    runs = [run_info(r) for r in rows]
    return [r for r in runs if r.last_report_ts is not None], int(active)


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


def _step_row(r: Any) -> JobStepSums:
    return JobStepSums(
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


def recent_steps(conn: Connection, after: Mapping[int, int]) -> dict[int, list[JobStepSums]]:
    """Job steps newer than ``after[run_id]``, per run (a primary-key range each)."""
    out: dict[int, list[JobStepSums]] = {run_id: [] for run_id in after}
    if not after:
        return out
    cond = or_(*(and_(JS.c.run_id == run_id, JS.c.step > step) for run_id, step in after.items()))
    for r in conn.execute(select(*_STEP_COLS).where(cond)):
        out[r.run_id].append(_step_row(r))
    return out


def first_untagged_steps(conn: Connection, run_id: int, limit: int) -> list[JobStepSums]:
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


# -- across ranks, computed by the database -------------------------------------------

#: Per-step means of a window row, as :class:`RankWindowSums` computes them. The divisor
#: cast to float: an integer one makes SQLAlchemy cast it to NUMERIC on PostgreSQL, which
#: then casts it back to float8 for the division, two casts per row and aggregate that
#: cost half of the window census at 16,384 ranks (same values).
_STEP_TIME = case((RW.c.n_steps > 0, RW.c.step_time_sum / cast(RW.c.n_steps, Float)), else_=0.0)
_DATA_WAIT = case((RW.c.n_steps > 0, RW.c.data_wait_sum / cast(RW.c.n_steps, Float)), else_=0.0)
#: A row of a profiled window whose breakdown is known (``RankWindowSums.profiled``).
_PROFILED = and_(RW.c.profiled_steps.is_not(None), RW.c.compute_s.is_not(None))


def _in_windows(windows: Mapping[int, Collection[int]]) -> ColumnElement[bool]:
    return or_(
        false(),
        *(and_(RW.c.run_id == run_id, RW.c.window.in_(sorted(ws))) for run_id, ws in windows.items() if ws),
    )


Quantiles = tuple[tuple[float, float], ...]
#: The per-rank quantities of a window's census, in the order its query computes them.
CENSUS_QUANTITIES = ("step_time", "data_wait")


@dataclass(frozen=True, slots=True)
class WindowCensus:
    """One window of a run: how many ranks stored a row, their values' totals and, where
    the database computes them in the same pass (PostgreSQL), the values' quantiles."""

    ranks: int
    step_time_total: float
    data_wait_total: float
    quantiles: Mapping[str, Quantiles] | None = None


def _percentiles(value: ColumnElement[Any]) -> Any:
    """PostgreSQL's ``percentile_cont`` at every exported quantile: the same linear
    interpolation between order statistics as ``state.quantiles``."""
    return func.percentile_cont(literal(list(QUANTILES), ARRAY(Float))).within_group(cast(value, Float))


def _quantiles_of(values: Any) -> Quantiles:
    return tuple((q, float(v)) for q, v in zip(QUANTILES, values or (), strict=False))


def window_census(conn: Connection, windows: Mapping[int, int]) -> dict[int, WindowCensus]:
    """Per run, its given window (``windows[run_id]``): the rank count and totals and, on
    PostgreSQL, the quantiles of step time and data wait, in one pass over the window's
    rows (index ``(run_id, window)``). A run whose window has no row is absent.

    One window per run: the caller asks for the previous window, and for the newest
    only where the previous one has no row (a run's first window). Both windows in one
    grouped pass cost twice the rows and a sort by window, about half of a scrape at
    16,384 ranks."""
    if not windows:
        return {}
    pg = is_postgres(conn)
    extra = (_percentiles(_STEP_TIME), _percentiles(_DATA_WAIT)) if pg else ()
    q = (
        select(RW.c.run_id, func.count(), func.sum(_STEP_TIME), func.sum(_DATA_WAIT), *extra)
        .where(_in_windows({r: (w,) for r, w in windows.items()}))
        .group_by(RW.c.run_id)
    )
    out = {}
    for run_id, n, st, dw, *qs in conn.execute(q):
        quantiles = dict(zip(CENSUS_QUANTITIES, map(_quantiles_of, qs), strict=True)) if pg else None
        out[run_id] = WindowCensus(int(n), float(st or 0.0), float(dw or 0.0), quantiles)
    return out


#: What the stored rank rows of one window add up to in ``job_steps``: (steps stored,
#: rank-steps stored). See :func:`window_signatures`.
Signature = tuple[int, int]


def window_signatures(
    conn: Connection, windows: Iterable[tuple[int, int, int]]
) -> dict[tuple[int, int], Signature]:
    """Per ``(run_id, window)`` asked as ``(run_id, window, window_steps)``: how many steps
    of the window ``job_steps`` holds and how many rank reports they add up to: a range of
    the primary key each, ``window_steps`` rows whatever the run's rank count.

    Every ingest that changes a window's step columns in ``rank_windows`` (``n_steps``,
    the step-time and data-wait sums: what :func:`window_census` reads) adds the same
    steps' ranks to ``job_steps`` in the same transaction (``ingest/fold.py``), so a
    window whose signature has not changed since its census was read still has that
    census: the exporter reads the census again only when this changes (or, for the one
    other writer, ``stepwatch db prune`` rolling up windows days old, after
    ``collector.CENSUS_MAX_AGE_S``), and uses a census the analysis stored
    (``summaries.py``) only while it holds. A window with no step stored is absent."""
    out: dict[tuple[int, int], Signature] = {}
    pending = sorted(set(windows))
    # One query per window asked of a run (the first, the second, ...: at most three per
    # run for a scrape), each an index range per run grouped by run, so that the query
    # grows with the runs as the rest of a scrape does, never one term per window.
    while pending:
        spans: dict[int, tuple[int, int, int]] = {}
        later = []
        for run_id, w, n in pending:
            if run_id in spans:
                later.append((run_id, w, n))
            else:
                spans[run_id] = (w, *steps_of(w, n))
        cond = or_(*(and_(JS.c.run_id == r, JS.c.step.between(lo, hi)) for r, (_, lo, hi) in spans.items()))
        q = select(JS.c.run_id, func.count(), func.sum(JS.c.ranks)).where(cond).group_by(JS.c.run_id)
        for run_id, n, ranks in conn.execute(q):
            out[(run_id, spans[run_id][0])] = (int(n), int(ranks or 0))
        pending = later
    return out


@dataclass(frozen=True, slots=True)
class ProfiledSummary:
    """The profiled rows of a run's newest profiled window: counts, totals, means and,
    on PostgreSQL, the quantiles of compute and collective wait."""

    ranks: int
    compute_total: float
    comm_wait_ranks: int
    comm_wait_total: float
    #: Mean over the profiled ranks of each part of the step (``state.PHASES``).
    means: Mapping[str, float]
    quantiles: Mapping[str, Quantiles] | None = None


def profiled_summary(conn: Connection, windows: Mapping[int, int]) -> dict[int, ProfiledSummary]:
    """Per run, the breakdown of its given profiled window (runs without one: absent)."""
    if not windows:
        return {}
    cond = and_(_PROFILED, _in_windows({r: [w] for r, w in windows.items()}))
    # The means over the profiled ranks as sums divided by the row count here: the
    # value of avg(coalesce(x, 0)) on both backends (the same sum over the same rows,
    # NULLs adding nothing), without avg's per-row variance terms or the coalesce (a
    # fifth of the query at 16,384 ranks). Compute is never NULL in these rows.
    parts = {
        "comm_overlapped": RW.c.comm_overlapped_s,
        "comm_exposed": RW.c.comm_exposed_s,
        "data_wait": _DATA_WAIT,
        "idle": RW.c.idle_s,
    }
    pg = is_postgres(conn)
    extra = (
        (_percentiles(RW.c.compute_s), _percentiles(RW.c.comm_wait_s).filter(RW.c.comm_wait_s.is_not(None)))
        if pg
        else ()
    )
    q = (
        select(
            RW.c.run_id,
            func.count(),
            func.sum(RW.c.compute_s),
            func.count(RW.c.comm_wait_s),
            func.sum(RW.c.comm_wait_s),
            *(func.sum(v) for v in parts.values()),
            *extra,
        )
        .where(cond)
        .group_by(RW.c.run_id)
    )
    out = {}
    for run_id, n, compute, n_wait, wait, *rest in conn.execute(q):
        sums, qs = rest[: len(parts)], rest[len(parts) :]
        means = {"compute": float(compute or 0.0) / n}
        means.update((k, float(x or 0.0) / n) for k, x in zip(parts, sums, strict=True))
        out[run_id] = ProfiledSummary(
            ranks=int(n),
            compute_total=float(compute or 0.0),
            comm_wait_ranks=int(n_wait),
            comm_wait_total=float(wait or 0.0),
            means=means,
            quantiles={"compute": _quantiles_of(qs[0]), "comm_wait": _quantiles_of(qs[1])} if pg else None,
        )
    return out


def _source(quantity: str, window: int) -> tuple[ColumnElement[Any], list[ColumnElement[bool]]]:
    """The value of ``quantity`` per rank row and the rows it is read from."""
    if quantity in ("step_time", "data_wait"):
        return (_STEP_TIME if quantity == "step_time" else _DATA_WAIT), [RW.c.window == window]
    if quantity == "compute":
        return RW.c.compute_s, [RW.c.window == window, _PROFILED]
    return RW.c.comm_wait_s, [RW.c.window == window, _PROFILED, RW.c.comm_wait_s.is_not(None)]


def top_ranks(
    conn: Connection, wanted: Mapping[int, tuple[str, int]], k: int
) -> dict[int, list[tuple[int, float]]]:
    """Per run, the ``k`` largest values of one quantity in one window (``wanted[run_id]
    = (quantity, window)``), largest first, ties to the lower rank. By compute time: the
    first ``k`` entries of the profiled rows' index, ordered so (``ix_rank_windows_profiled``,
    migration 0014); by step time (a run without a profiler): a top-N sort of the window."""
    out: dict[int, list[tuple[int, float]]] = {run_id: [] for run_id in wanted}
    for run_id, (quantity, window) in wanted.items():
        value, conds = _source(quantity, window)
        # Ordered by the value itself, not its cast, so that the index can give the order.
        q = (
            select(RW.c.rank, cast(value, Float))
            .where(RW.c.run_id == run_id, *conds)
            .order_by(value.desc(), RW.c.rank)
            .limit(k)
        )
        out[run_id] = [(int(r), float(x)) for r, x in conn.execute(q)]
    return out


def order_statistics(
    conn: Connection, wanted: Mapping[int, Mapping[str, tuple[int, Collection[int]]]]
) -> dict[int, dict[str, dict[int, float]]]:
    """Where the database has no ``percentile_cont`` (SQLite): chosen order statistics
    of each quantity across a run's ranks, ``wanted[run_id][quantity] = (window,
    positions)``, in one query ranking the rows (``row_number``): only the wanted
    positions come back."""
    out: dict[int, dict[str, dict[int, float]]] = {run_id: {} for run_id in wanted}
    sources, picks = [], []
    for run_id, quantities in wanted.items():
        for quantity, (window, _) in quantities.items():
            value, conds = _source(quantity, window)
            code = literal(_QUANTITY_CODE[quantity]).label("q")
            sources.append(
                select(RW.c.run_id, code, RW.c.rank, cast(value, Float).label("v")).where(
                    RW.c.run_id == run_id, *conds
                )
            )
    if not sources:
        return out
    u = union_all(*sources).subquery()
    i = (func.row_number().over(partition_by=(u.c.run_id, u.c.q), order_by=(u.c.v, u.c.rank)) - 1).label("i")
    ordered = select(u.c.run_id, u.c.q, u.c.v, i).subquery()
    for run_id, quantities in wanted.items():
        for quantity, (_, positions) in quantities.items():
            picks.append(
                and_(
                    ordered.c.run_id == run_id,
                    ordered.c.q == _QUANTITY_CODE[quantity],
                    ordered.c.i.in_(sorted(positions)),
                )
            )
    q = select(ordered.c.run_id, ordered.c.q, ordered.c.i, ordered.c.v).where(or_(false(), *picks))
    for run_id, code, pos, v in conn.execute(q):
        out[run_id].setdefault(RANK_QUANTITIES[code], {})[int(pos)] = float(v)
    return out


_QUANTITY_CODE = {q: i for i, q in enumerate(RANK_QUANTITIES)}


def rank_rows(
    conn: Connection, wanted: Mapping[int, tuple[Collection[int], Collection[int]]]
) -> dict[int, list[RankWindowSums]]:
    """The rows of the given ranks in the given windows, per run: ``wanted[run_id] =
    (windows, ranks)`` (primary-key probes: the selected ranks only)."""
    out: dict[int, list[RankWindowSums]] = {run_id: [] for run_id in wanted}
    conds = [
        and_(RW.c.run_id == run_id, RW.c.window.in_(sorted(ws)), RW.c.rank.in_(sorted(rs)))
        for run_id, (ws, rs) in wanted.items()
        if ws and rs
    ]
    if not conds:
        return out
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
    ).where(or_(*conds))
    for r in conn.execute(q):
        out[r.run_id].append(
            RankWindowSums(
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
