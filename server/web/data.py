"""What the web page shows, read from the database as plain dicts.

The page reuses the API's queries (``reads/queries.py``) so that the page and the API never
disagree, and adds two reads of its own that only a picture needs: the per-rank heatmap
over recent windows and the latest profiled breakdown. Both are bounded (ranks shown,
windows shown) so that a 4,096-rank run renders as fast as a 4-rank one.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, Float, and_, cast, func, select
from sqlalchemy.sql.elements import ColumnElement

from ..reads import queries
from ..reads.runs import get_run
from ..reads.status import DEFAULT_RULE, StatusRule
from ..storage.models import Event, ProfileWindow, RankWindow

RW = RankWindow.__table__
EV = Event.__table__
PW = ProfileWindow.__table__

#: Heatmap metrics: key -> (label, SQL expression of the per-step mean in a rank window).
HEAT_METRICS: dict[str, tuple[str, ColumnElement[Any]]] = {
    "step_time_s": ("step time", RW.c.step_time_sum / RW.c.n_steps),
    "compute_s": ("compute", RW.c.compute_s),
    "comm_wait_s": ("collective wait", RW.c.comm_wait_s),
    "comm_exposed_s": ("exposed communication", RW.c.comm_exposed_s),
    "data_wait_s": ("data wait", cast(RW.c.data_wait_sum, Float) / RW.c.n_steps),
}
#: Parts of a step (DESIGN §3), in stacking order, with their colours on the page.
BREAKDOWN = (
    ("compute_s", "compute", "#3b8c5a"),
    ("comm_overlapped_s", "comm overlapped", "#5aa9d6"),
    ("comm_exposed_s", "comm exposed", "#d64545"),
    ("data_wait_s", "data wait", "#e0a030"),
    ("idle_s", "idle", "#9aa0a6"),
)
CHART_METRICS = ("mfu", "tokens_per_s", "step_time_s", "step_time_max_s")


@dataclass
class Heatmap:
    """Ranks x windows of one metric; each cell coloured by its ratio to the window's
    median over the ranks shown (red: slower than its peers, blue: faster)."""

    metric: str
    label: str
    ranks: list[int]
    windows: list[dict[str, int]]
    cells: list[list[dict[str, Any] | None]]
    total_ranks: int
    available: list[str] = field(default_factory=list)


def runs(
    conn: Connection, *, offset: int = 0, rule: StatusRule = DEFAULT_RULE
) -> tuple[list[dict[str, Any]], int]:
    """One page of runs (the API's pagination) with their open flags, and the total."""
    page, total = queries.list_runs(conn, offset=offset, rule=rule)
    out = [r.model_dump() for r in page]
    ids = dict(
        conn.execute(
            select(queries.RUNS.c.name, queries.RUNS.c.id).where(
                queries.RUNS.c.name.in_([r["name"] for r in out])
            )
        ).all()
    )
    open_counts: dict[int, int] = dict(
        conn.execute(
            select(EV.c.run_id, func.count())
            .where(EV.c.status == "open", EV.c.run_id.in_(list(ids.values())))
            .group_by(EV.c.run_id)
        ).all()
    )
    for r in out:
        r["open_events"] = open_counts.get(ids.get(r["name"], -1), 0)
    return out, total


def _series(conn: Connection, run: str, metric: str, max_points: int) -> dict[str, Any]:
    s = queries.series(conn, run, metric, from_step=None, to_step=None, max_points=max_points)
    return {
        "step": [p.step_to for p in s.points],
        "mean": [p.mean for p in s.points],
        "min": [p.min for p in s.points],
        "max": [p.max for p in s.points],
        "reason": s.reason,  # why there are no points (no MFU without a peak FLOP/s)
    }


def _last_window(conn: Connection, run_id: int) -> int | None:
    last: int | None = conn.execute(select(func.max(RW.c.window)).where(RW.c.run_id == run_id)).scalar()
    return last


def breakdown(conn: Connection, run_id: int, *, since_window: int) -> dict[str, Any] | None:
    """Mean over ranks of the latest window (after ``since_window``) with profiler data."""
    last = conn.execute(
        select(func.max(RW.c.window)).where(
            RW.c.run_id == run_id, RW.c.window > since_window, RW.c.compute_s.is_not(None)
        )
    ).scalar()
    if last is None:
        return None
    row = conn.execute(
        select(
            func.avg(RW.c.compute_s),
            func.avg(RW.c.comm_overlapped_s),
            func.avg(RW.c.comm_exposed_s),
            func.avg(cast(RW.c.data_wait_sum, Float) / RW.c.n_steps),
            func.avg(RW.c.idle_s),
            func.min(RW.c.first_step),
            func.max(RW.c.last_step),
        ).where(RW.c.run_id == run_id, RW.c.window == last, RW.c.compute_s.is_not(None))
    ).one()
    values = [float(v or 0.0) for v in row[:5]]
    total = sum(values)
    # The steps the profiler actually captured inside that window (a window of 32 steps
    # may hold one profiled span of 2), not the window's bounds.
    spans = conn.execute(
        select(PW.c.first_step, func.max(PW.c.n_steps))
        .where(PW.c.run_id == run_id, PW.c.window == last, PW.c.n_steps > 0)
        .group_by(PW.c.first_step)
        .order_by(PW.c.first_step)
        .limit(8)
    ).all()
    parts = [
        {"key": key, "label": label, "color": color, "seconds": v, "share": v / total if total > 0 else 0.0}
        for (key, label, color), v in zip(BREAKDOWN, values, strict=True)
    ]
    comm = values[1] + values[2]
    return {
        "parts": parts,
        "total_s": total,
        "steps": (row[5], row[6]),
        "profiled": [(first, first + n - 1) for first, n in spans],
        "overlap_ratio": values[1] / comm if comm > 0 else None,
    }


def _color(ratio: float | None) -> str:
    """White at the median, red towards +30% and beyond, blue towards -30%."""
    if ratio is None:
        return "#eeeeee"
    t = max(-1.0, min(1.0, (ratio - 1.0) / 0.3))
    if t >= 0:
        r, g, b = 255, round(255 - 185 * t), round(255 - 195 * t)
    else:
        r, g, b = round(255 + 175 * t), round(255 + 110 * t), 255
    return f"#{r:02x}{g:02x}{b:02x}"


def heatmap(
    conn: Connection,
    run_id: int,
    *,
    metric: str | None,
    flagged: set[int],
    last: int,
    max_ranks: int = 64,
    max_windows: int = 90,
) -> Heatmap:
    """Only the last ``max_windows`` windows and at most ``max_ranks`` ranks are read."""
    where = and_(RW.c.run_id == run_id, RW.c.window > last - max_windows)
    available = [
        key
        for key, (_, expr) in HEAT_METRICS.items()
        if conn.execute(select(RW.c.rank).where(where, expr.is_not(None)).limit(1)).first() is not None
    ]
    if metric not in available:
        metric = "compute_s" if "compute_s" in available else "step_time_s"
    label, expr = HEAT_METRICS[metric]
    recent = and_(where, expr.is_not(None))
    total = conn.execute(select(func.count()).where(queries.RANKS.c.run_id == run_id)).scalar_one()
    rank_filter = None
    if total > max_ranks:  # flagged ranks first, then the slowest on average
        by_mean = conn.execute(
            select(RW.c.rank).where(recent).group_by(RW.c.rank).order_by(func.avg(expr).desc(), RW.c.rank)
        ).scalars()
        chosen = sorted(flagged)[:max_ranks]
        for r in by_mean:
            if len(chosen) >= max_ranks:
                break
            if r not in chosen:
                chosen.append(r)
        rank_filter = RW.c.rank.in_(chosen)
    q = select(RW.c.rank, RW.c.window, RW.c.first_step, RW.c.last_step, expr.label("v")).where(recent)
    if rank_filter is not None:
        q = q.where(rank_filter)
    rows = conn.execute(q).all()
    ranks = sorted({r.rank for r in rows})
    windows = sorted({(r.window, r.first_step, r.last_step) for r in rows})
    w_index = {w[0]: i for i, w in enumerate(windows)}
    r_index = {r: i for i, r in enumerate(ranks)}
    values: list[list[float | None]] = [[None] * len(windows) for _ in ranks]
    for r in rows:
        values[r_index[r.rank]][w_index[r.window]] = None if r.v is None else float(r.v)
    cells: list[list[dict[str, Any] | None]] = [[None] * len(windows) for _ in ranks]
    for j in range(len(windows)):
        column = [v for v in (values[i][j] for i in range(len(ranks))) if v is not None]
        med = statistics.median(column) if column else None
        for i in range(len(ranks)):
            v = values[i][j]
            if v is None:
                continue
            ratio = v / med if med else None
            cells[i][j] = {"value": v, "ratio": ratio, "color": _color(ratio)}
    return Heatmap(
        metric=metric,
        label=label,
        ranks=ranks,
        windows=[{"window": w, "first_step": f, "last_step": last_step} for w, f, last_step in windows],
        cells=cells,
        total_ranks=total,
        available=available,
    )


def run_page(
    conn: Connection, name: str, *, heat: str | None = None, rule: StatusRule = DEFAULT_RULE
) -> dict[str, Any]:
    """Everything the run page shows. Raises ``NotFoundError`` for an unknown run."""
    run = get_run(conn, name)
    overview = queries.overview(conn, name, rule=rule).model_dump()
    ranks = [r.model_dump() for r in queries.ranks(conn, name)]
    events = [e.model_dump() for e in queries.events(conn, name)]
    flagged = {int(r) for e in events if e["status"] == "open" for r in e["ranks"]}
    charts = {m: _series(conn, name, m, 600) for m in CHART_METRICS}
    last = _last_window(conn, run.id)
    return {
        "overview": overview,
        "progress": overview.get("progress"),
        "ranks": ranks,
        "events": events,
        "flagged": flagged,
        "charts": charts,
        "breakdown": None if last is None else breakdown(conn, run.id, since_window=last - 90),
        "heatmap": None if last is None else heatmap(conn, run.id, metric=heat, flagged=flagged, last=last),
    }
