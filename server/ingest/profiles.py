"""Storing profiler windows, inside the ingest transaction of the batch that carries them.

For each window of one rank (``payload.profiles``):

1. ``profile_windows``: one row with the breakdown means, top ops, NVML, clock offset and
   the agent's self-measured cost (or the reason the window was skipped).
2. ``rank_windows``: the breakdown columns are running means per profiled step of the
   rank window that holds the step (``profiled_steps`` is their weight,
   :func:`~..storage.columns.running_means`), updated by one atomic ``UPDATE`` each, so
   two batches touching one window cannot lose an update. A profile whose steps were
   never stored (their batch was dropped) updates nothing.
3. ``collective_stats``: per op type, count, bytes and the duration sketch.
4. Wait vs transfer needs every rank's arrival times: the rank's times are staged in
   ``profile_arrivals`` and ``profile_pending.arrivals`` is incremented; the ingest that
   sees it reach the world size (the row lock of that increment orders the ranks, on
   PostgreSQL as on SQLite) runs :func:`stepwatch.profiler.lineup.split_wait_transfer` for
   all ranks, writes ``comm_wait_s``/``comm_transfer_s`` (running means weighted by
   ``skew_steps``), the transfer per communicator type (``group_transfer_s``: the newest
   window's means per step, typed by which coordinate the group's members differ in) and
   the wait/transfer sketches, and deletes the staging rows. A window
   that some rank never reports (it skipped it: a longer stretched period, a crash) stays
   pending until it falls out of the newest :data:`PENDING_KEEP` pending windows of the
   run, and is then dropped: no wait/transfer is better than a wrong one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, cast

from sqlalchemy import Connection, Table, bindparam, delete, select, update

from stepwatch.profiler.lineup import GroupArrivals, split_wait_transfer
from stepwatch.sketch import LogSketch

from ..schemas.ingest import IngestPayload, ProfileIn
from ..storage import columns
from ..storage.backend import Storage
from ..storage.columns import BREAKDOWN, SKEW, window_of
from ..storage.models import CollectiveStat, ProfileArrival, ProfilePending, ProfileWindow, Rank, RankWindow
from . import acks

PENDING_KEEP = 16
SKETCH_ALPHA = 0.01
PW = cast(Table, ProfileWindow.__table__)
CS = cast(Table, CollectiveStat.__table__)
PP = cast(Table, ProfilePending.__table__)
PA = cast(Table, ProfileArrival.__table__)
RW = cast(Table, RankWindow.__table__)
RK = cast(Table, Rank.__table__)

Insert = Callable[[Table], Any]


def _mean(values: Sequence[float]) -> float | None:
    return math.fsum(values) / len(values) if values else None


def store(
    conn: Connection, storage: Storage, run_id: int, window_steps: int, world_size: int, p: IngestPayload
) -> None:
    """Store the profiler data a fresh batch carries (most carry none)."""
    for prof in p.profiles or ():
        _store_one(conn, storage.insert, run_id, window_steps, world_size, p, prof)


def _store_one(
    conn: Connection,
    insert: Insert,
    run_id: int,
    window_steps: int,
    world_size: int,
    p: IngestPayload,
    prof: ProfileIn,
) -> None:
    rank = p.rank.rank
    n = prof.n_steps
    win = window_of(prof.first_step, window_steps)
    nv, clock, cost = prof.nvml, prof.clock, prof.cost
    conn.execute(
        insert(PW)
        .values(
            run_id=run_id,
            rank=rank,
            first_step=prof.first_step,
            window=win,
            n_steps=n,
            device=prof.device,
            skipped=prof.skipped,
            step_s=_mean(prof.time_s),
            compute_s=_mean(prof.compute_s),
            comm_overlapped_s=_mean(prof.comm_overlapped_s),
            comm_exposed_s=_mean(prof.comm_exposed_s),
            data_wait_s=_mean(prof.data_wait_s),
            idle_s=_mean(prof.idle_s),
            top_ops=[o.model_dump() for o in prof.top_ops] if n else None,
            gpu_uuid=nv.gpu_uuid if nv else None,
            sm_clock_mhz=nv.sm_clock_mhz if nv else None,
            power_w=nv.power_w if nv else None,
            temperature_c=nv.temperature_c if nv else None,
            throttle_reasons=nv.throttle_reasons if nv else None,
            clock_offset_s=clock.offset_s if clock else None,
            clock_uncertainty_s=clock.uncertainty_s if clock else None,
            clock_method=clock.method if clock else None,
            cost_s=cost.window_s if cost else None,
            overhead_ratio=cost.overhead_ratio if cost else None,
            profile_every=cost.every if cost else None,
            wall_end=p.steps.wall_end,
        )
        .on_conflict_do_nothing(index_elements=["run_id", "rank", "first_step"])
    )
    if n:
        _update_rank_windows(conn, run_id, rank, window_steps, prof)
        rows = [
            {
                "run_id": run_id,
                "rank": rank,
                "first_step": prof.first_step,
                "op": c.op,
                "window": win,
                "count": c.count,
                "bytes": c.bytes,
                "duration": c.duration,
            }
            for c in prof.collectives
        ]
        if rows:
            conn.execute(
                insert(CS).on_conflict_do_nothing(index_elements=["run_id", "rank", "first_step", "op"]), rows
            )
    # Every report counts, a skipped one too: the window then completes without this
    # rank's groups (their collectives have no known last arrival and are left out).
    data = {
        "t0": prof.t0,
        "offset_s": clock.offset_s if clock else None,
        "groups": [g.model_dump() for g in prof.arrivals],
    }
    conn.execute(
        insert(PA)
        .values(run_id=run_id, first_step=prof.first_step, rank=rank, data=data)
        .on_conflict_do_nothing(index_elements=["run_id", "first_step", "rank"])
    )
    stmt = insert(PP).values(run_id=run_id, first_step=prof.first_step, arrivals=1)
    count = conn.execute(
        stmt.on_conflict_do_update(
            index_elements=["run_id", "first_step"], set_={"arrivals": PP.c.arrivals + 1}
        ).returning(PP.c.arrivals)
    ).scalar_one()
    # A capture's window completes when the ranks it asked for have answered.
    expected = acks.capture_size(conn, run_id, prof.capture) or world_size
    if count >= expected:
        finalize(
            conn, run_id=run_id, first_step=prof.first_step, window_steps=window_steps, world_size=world_size
        )
    elif count == 1:
        _prune(conn, run_id)


def _update_rank_windows(
    conn: Connection, run_id: int, rank: int, window_steps: int, prof: ProfileIn
) -> None:
    by_window: dict[int, list[int]] = {}
    for j in range(prof.n_steps):
        by_window.setdefault(window_of(prof.first_step + j, window_steps), []).append(j)
    stmt = (
        update(RW)
        .where(RW.c.run_id == run_id, RW.c.rank == rank, RW.c.window == bindparam("w"))
        .values(**columns.running_means(BREAKDOWN))
    )
    params = []
    for w, js in by_window.items():
        row: dict[str, Any] = {"w": w, "k": len(js)}
        for col in BREAKDOWN:
            series = getattr(prof, col)
            row[f"s_{col}"] = math.fsum(series[j] for j in js)
        params.append(row)
    conn.execute(stmt, params)


def _sketch(values: Sequence[float]) -> dict[str, object]:
    sk = LogSketch(SKETCH_ALPHA)
    for v in values:
        sk.add(v)
    return sk.to_dict()


def finalize(conn: Connection, *, run_id: int, first_step: int, window_steps: int, world_size: int) -> None:
    """Split wait from transfer for every rank of a window all ranks have reported."""
    rows = conn.execute(
        select(PA.c.rank, PA.c.data).where(PA.c.run_id == run_id, PA.c.first_step == first_step)
    ).all()
    arrivals: dict[int, list[GroupArrivals]] = {}
    offsets: dict[int, float] = {}
    # Times relative to the earliest t0: differences of nearby Unix times are exact, so
    # the split keeps sub-microsecond precision (absolute Unix seconds have ~0.2 µs).
    ref = min((data.get("t0") or 0.0 for _, data in rows), default=0.0)
    for rank, data in rows:
        t0 = (data.get("t0") or ref) - ref
        offsets[rank] = data.get("offset_s") or 0.0
        arrivals[rank] = [
            GroupArrivals(
                group=g["group"],
                ranks=tuple(g["ranks"]) if g.get("ranks") else None,
                size=g.get("size"),
                key_kind=g["key_kind"],
                step=g["step"],
                op=g["op"],
                key=g["key"],
                enter=[t0 + x for x in g["enter"]],
                end=[t0 + x for x in g["end"]],
            )
            for g in data.get("groups") or ()
        ]
    result = split_wait_transfer(arrivals, world_size=world_size, offsets=offsets)
    types = _group_types(conn, run_id, {m for skew in result.values() for _, m in skew.groups if m})
    rw_params: list[dict[str, Any]] = []
    gt_params: list[dict[str, Any]] = []
    cs_params: list[dict[str, Any]] = []
    for rank, skew in result.items():
        per_window: dict[int, list[float]] = {}
        for step, (wait, transfer, _) in skew.steps.items():
            acc = per_window.setdefault(window_of(step, window_steps), [0.0, 0.0, 0.0])
            acc[0] += wait
            acc[1] += transfer
            acc[2] += 1
        rw_params += [
            {"r": rank, "w": w, "s_comm_wait_s": acc[0], "s_comm_transfer_s": acc[1], "k": int(acc[2])}
            for w, acc in per_window.items()
        ]
        by_type: dict[int, dict[str, float]] = {}
        for (step, members), transfer in skew.groups.items():
            gtype = types.get(members) if members else None
            if gtype is not None:
                per_type = by_type.setdefault(window_of(step, window_steps), {})
                per_type[gtype] = per_type.get(gtype, 0.0) + transfer
        gt_params += [
            {"r": rank, "w": w, "gt": {t: v / per_window[w][2] for t, v in per_type.items()}}
            for w, per_type in by_type.items()
        ]
        cs_params += [
            {"r": rank, "o": op, "wv": _sketch(waits), "tv": _sketch(transfers)}
            for op, (waits, transfers) in skew.ops.items()
        ]
    if rw_params:
        conn.execute(
            update(RW)
            .where(RW.c.run_id == run_id, RW.c.rank == bindparam("r"), RW.c.window == bindparam("w"))
            .values(**columns.running_means(SKEW)),
            rw_params,
        )
    if gt_params:
        conn.execute(
            update(RW)
            .where(RW.c.run_id == run_id, RW.c.rank == bindparam("r"), RW.c.window == bindparam("w"))
            .values(group_transfer_s=bindparam("gt", type_=RW.c.group_transfer_s.type)),
            gt_params,
        )
    if cs_params:
        conn.execute(
            update(CS)
            .where(
                CS.c.run_id == run_id,
                CS.c.rank == bindparam("r"),
                CS.c.first_step == first_step,
                CS.c.op == bindparam("o"),
            )
            .values(wait=bindparam("wv"), transfer=bindparam("tv")),
            cs_params,
        )
    conn.execute(delete(PA).where(PA.c.run_id == run_id, PA.c.first_step == first_step))
    conn.execute(delete(PP).where(PP.c.run_id == run_id, PP.c.first_step == first_step))


def _group_types(conn: Connection, run_id: int, groups: set[tuple[int, ...]]) -> dict[tuple[int, ...], str]:
    """Members -> communicator type: the one layout coordinate in which the members differ
    (a group of the ranks that agree on every coordinate but X is an X group). Groups that
    differ in no or several coordinates have no type."""
    if not groups:
        return {}
    coords = {
        rank: c or {} for rank, c in conn.execute(select(RK.c.rank, RK.c.coords).where(RK.c.run_id == run_id))
    }
    out: dict[tuple[int, ...], str] = {}
    for members in groups:
        cs = [coords.get(r, {}) for r in members]
        differ = [d for d in ("dp", "tp", "cp", "pp") if len({int(c.get(d, 0)) for c in cs}) > 1]
        if len(differ) == 1:
            out[members] = differ[0]
    return out


def _prune(conn: Connection, run_id: int) -> None:
    """Drop pending windows beyond the newest PENDING_KEEP of the run (never completed)."""
    old = [
        r[0]
        for r in conn.execute(
            select(PP.c.first_step)
            .where(PP.c.run_id == run_id)
            .order_by(PP.c.first_step.desc())
            .offset(PENDING_KEEP)
        )
    ]
    if old:
        conn.execute(delete(PA).where(PA.c.run_id == run_id, PA.c.first_step.in_(old)))
        conn.execute(delete(PP).where(PP.c.run_id == run_id, PP.c.first_step.in_(old)))
