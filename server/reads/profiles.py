"""Reads of the profiler-window data: per-rank breakdown and collectives, breakdown series.

Per rank (``/runs/{run}/ranks``): the newest profiler window that has data, and per
collective op type the count, bytes and p50/p99/max of duration, wait and transfer,
computed here from the sketches of the newest ``windows`` profiled windows merged
(exact merge: bucket counts add; quantiles within the sketches' 1% relative error).

Series (``/runs/{run}/series``): breakdown metrics are per stored rank window, and the
job value of a window is the **mean over the ranks** that have the metric in it (the
straggler analysis reads the per-rank values); ``overlap_ratio`` is the ratio of the
sums (overlapped / all communication over the ranks). Points downsample windows into
buckets of equal step width with min/mean/max of the window values.
"""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy import Connection, Float, and_, cast, func, select
from sqlalchemy.sql.elements import ColumnElement

from stepwatch.sketch import LogSketch

from ..schemas.responses import ClockOut, CollectiveOut, NvmlOut, ProfileOut, Quantiles, Series, SeriesPoint
from ..storage.models import CollectiveStat, ProfileWindow, RankWindow
from .buckets import buckets

PW = ProfileWindow.__table__
CS = CollectiveStat.__table__
RW = RankWindow.__table__

#: metric -> unit; served from rank windows (see the module docstring).
BREAKDOWN_METRICS: dict[str, str] = {
    "compute_s": "s",
    "comm_overlapped_s": "s",
    "comm_exposed_s": "s",
    "idle_s": "s",
    "comm_wait_s": "s",
    "comm_transfer_s": "s",
    "overlap_ratio": "ratio",
}


def _quantiles(sketches: list[dict[str, Any]]) -> Quantiles | None:
    if not sketches:
        return None
    merged = LogSketch.from_dict(sketches[0])
    for d in sketches[1:]:
        merged.merge(LogSketch.from_dict(d))
    return Quantiles(
        count=merged.count, p50=merged.quantile(0.5), p99=merged.quantile(0.99), max=merged.quantile(1.0)
    )


def _mean_sum(sketches: list[dict[str, Any] | None], n_steps: int) -> float | None:
    """Per-step total of a sketch's values (the sketches' exact sums over the steps)."""
    if not sketches or any(s is None for s in sketches) or n_steps <= 0:
        return None
    return math.fsum(float(s["sum"]) for s in sketches if s is not None) / n_steps


def _profile_out(r: Any, coll_rows: list[Any]) -> ProfileOut:
    over, exp = r.comm_overlapped_s, r.comm_exposed_s
    comm = (over or 0.0) + (exp or 0.0)
    mine = [c for c in coll_rows if c.first_step == r.first_step]
    has_nvml = any(
        v is not None for v in (r.gpu_uuid, r.sm_clock_mhz, r.power_w, r.temperature_c, r.throttle_reasons)
    )
    return ProfileOut(
        first_step=r.first_step,
        n_steps=r.n_steps,
        device=r.device,
        step_s=r.step_s,
        compute_s=r.compute_s,
        comm_overlapped_s=over,
        comm_exposed_s=exp,
        data_wait_s=r.data_wait_s,
        idle_s=r.idle_s,
        overlap_ratio=(over or 0.0) / comm if comm > 0 else None,
        comm_wait_s=_mean_sum([c.wait for c in mine], r.n_steps) if mine else 0.0,
        comm_transfer_s=_mean_sum([c.transfer for c in mine], r.n_steps) if mine else 0.0,
        top_ops=r.top_ops,
        nvml=NvmlOut(
            gpu_uuid=r.gpu_uuid,
            sm_clock_mhz=r.sm_clock_mhz,
            power_w=r.power_w,
            temperature_c=r.temperature_c,
            throttle_reasons=r.throttle_reasons,
        )
        if has_nvml
        else None,
        clock=ClockOut(offset_s=r.clock_offset_s, uncertainty_s=r.clock_uncertainty_s, method=r.clock_method),
        cost_s=r.cost_s,
        overhead_ratio=r.overhead_ratio,
        profile_every=r.profile_every,
    )


def rank_profiles(
    conn: Connection, run_id: int, windows: int
) -> dict[int, tuple[ProfileOut | None, str | None, list[CollectiveOut]]]:
    """rank -> (newest window with data, why the newest window was skipped, collectives)."""
    ranked = (
        select(
            PW.c.rank,
            PW.c.first_step,
            func.row_number().over(partition_by=PW.c.rank, order_by=PW.c.first_step.desc()).label("rn"),
        )
        .where(PW.c.run_id == run_id, PW.c.n_steps > 0)
        .subquery()
    )
    rows = conn.execute(
        select(PW, ranked.c.rn)
        .join(ranked, and_(PW.c.rank == ranked.c.rank, PW.c.first_step == ranked.c.first_step))
        .where(PW.c.run_id == run_id, ranked.c.rn <= windows)
    ).all()
    colls = conn.execute(
        select(CS)
        .join(ranked, and_(CS.c.rank == ranked.c.rank, CS.c.first_step == ranked.c.first_step))
        .where(CS.c.run_id == run_id, ranked.c.rn <= windows)
        .order_by(CS.c.rank, CS.c.op, CS.c.first_step)
    ).all()
    newest = (
        select(PW.c.rank, func.max(PW.c.first_step).label("fs"))
        .where(PW.c.run_id == run_id)
        .group_by(PW.c.rank)
    ).subquery()
    skipped = {
        r.rank: r.skipped
        for r in conn.execute(
            select(PW.c.rank, PW.c.skipped)
            .join(newest, and_(PW.c.rank == newest.c.rank, PW.c.first_step == newest.c.fs))
            .where(PW.c.run_id == run_id)
        )
    }
    by_rank_colls: dict[int, list[Any]] = {}
    for c in colls:
        by_rank_colls.setdefault(c.rank, []).append(c)
    out: dict[int, tuple[ProfileOut | None, str | None, list[CollectiveOut]]] = {}
    latest = {r.rank: r for r in rows if r.rn == 1}
    for rank in set(latest) | set(skipped):
        mine = by_rank_colls.get(rank, [])
        prof = _profile_out(latest[rank], mine) if rank in latest else None
        out[rank] = (prof, skipped.get(rank), _collectives(mine))
    return out


def _collectives(rows: list[Any]) -> list[CollectiveOut]:
    by_op: dict[str, list[Any]] = {}
    for c in rows:
        by_op.setdefault(c.op, []).append(c)
    out = []
    for op in sorted(by_op):
        items = by_op[op]
        sizes = [c.bytes for c in items]
        waits = [c.wait for c in items]
        transfers = [c.transfer for c in items]
        out.append(
            CollectiveOut(
                op=op,
                windows=len(items),
                count=sum(c.count for c in items),
                bytes=sum(b for b in sizes if b is not None) if all(b is not None for b in sizes) else None,
                duration_s=_quantiles([c.duration for c in items])
                or Quantiles(count=0, p50=None, p99=None, max=None),
                wait_s=_quantiles([w for w in waits if w is not None]),
                transfer_s=_quantiles([t for t in transfers if t is not None]),
            )
        )
    return out


def _window_value(metric: str) -> ColumnElement[Any]:
    if metric == "overlap_ratio":
        both = RW.c.comm_overlapped_s + RW.c.comm_exposed_s
        return func.sum(RW.c.comm_overlapped_s) / func.nullif(func.sum(both), 0.0)
    return func.avg(cast(RW.c[metric], Float))


def window_series(
    conn: Connection,
    run_id: int,
    name: str,
    metric: str,
    *,
    from_step: int | None,
    to_step: int | None,
    max_points: int,
) -> Series:
    """A breakdown metric over the run, one value per rank window (see the module docstring)."""
    unit = BREAKDOWN_METRICS[metric]
    col = RW.c.comm_overlapped_s if metric == "overlap_ratio" else RW.c[metric]
    per_window = (
        select(
            RW.c.window,
            func.min(RW.c.first_step).label("lo"),
            func.max(RW.c.last_step).label("hi"),
            _window_value(metric).label("v"),
        )
        .where(RW.c.run_id == run_id, col.is_not(None))
        .group_by(RW.c.window)
        .subquery()
    )
    lo = hi = None
    if from_step is None or to_step is None:
        lo, hi = conn.execute(select(func.min(per_window.c.lo), func.max(per_window.c.hi))).one()
    span = buckets(lo, hi, from_step, to_step, max_points)
    if span is None:
        return Series(run=name, metric=metric, unit=unit, points=[])
    from_step, to_step, width = span
    bucket = ((per_window.c.lo - from_step) // width).label("bucket")
    q = (
        select(
            bucket,
            func.min(per_window.c.lo),
            func.max(per_window.c.hi),
            func.count(),
            func.min(per_window.c.v),
            func.avg(per_window.c.v),
            func.max(per_window.c.v),
        )
        .where(per_window.c.lo >= from_step, per_window.c.lo <= to_step, per_window.c.v.is_not(None))
        .group_by(bucket)
        .order_by(bucket)
    )
    points = [
        SeriesPoint(
            step_from=r[1],
            step_to=r[2],
            count=r[3],
            min=None if r[4] is None else float(r[4]),
            mean=None if r[5] is None else float(r[5]),
            max=None if r[6] is None else float(r[6]),
        )
        for r in conn.execute(q)
    ]
    return Series(run=name, metric=metric, unit=unit, points=points)
