"""Fold a group of validated batches into the rows that ingest merges into the database.

Pure functions over plain data (no database): a group of batches becomes one row per
(run, rank) for ``ranks``, one per (run, rank, window) for ``rank_windows`` and one per
(run, step) for ``job_steps``, each already summed over the group, so the database
merges a few hundred rows instead of one per rank-step. The per-step work is vectorised
with numpy (``reduceat`` over runs of equal keys: job steps sorted by key first; rank
windows, whose steps a batch already holds together, in arrival order): at 4,096 ranks it
is the collector's hot loop, and a Python loop over every rank-step cost more than the
database itself.

Each column folds by its merge rule (``storage/columns.py``), the rule the upserts
apply between groups, so a group folded here and the same batches merged one by one
give the same rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

import numpy as np
import numpy.typing as npt

from stepwatch import wire

from ..schemas.ingest import IngestPayload, Tag
from ..storage import columns, packed
from ..storage.columns import Columns, Rows


def fold(payloads: Sequence[IngestPayload], run_ids: Sequence[int], window_steps: Sequence[int]) -> Rows:
    """Rows for a group of batches; ``payloads`` must be distinct batches (claimed)."""
    # A rank's final batch may carry no step: it updates the rank's row only.
    stepped = [i for i, p in enumerate(payloads) if p.steps.time_s]
    windows: Columns = {}
    job_steps: Columns = {}
    if stepped:
        windows, job_steps = _fold_steps(
            [payloads[i] for i in stepped], [run_ids[i] for i in stepped], [window_steps[i] for i in stepped]
        )
    timed = [i for i in stepped if payloads[i].comm is not None]
    timings = _step_timings([payloads[i] for i in timed], [run_ids[i] for i in timed]) if timed else {}
    linked = [i for i in timed if payloads[i].comm.links]  # type: ignore[union-attr]
    links = _link_samples([payloads[i] for i in linked], [run_ids[i] for i in linked]) if linked else {}
    return Rows(
        ranks=_ranks(payloads, run_ids),
        windows=windows,
        job_steps=job_steps,
        step_timings=timings,
        rank_groups=_rank_groups(payloads, run_ids),
        link_samples=links,
    )


def _rank_groups(payloads: Sequence[IngestPayload], run_ids: Sequence[int]) -> Columns:
    """One ``rank_groups`` row per (run, rank, group) of the batches' ``comm.groups``;
    batches of one rank in the group merge by the table's rules, in arrival order."""
    table = columns.RANK_GROUPS
    merged: dict[tuple[int, int, str], dict[str, Any]] = {}
    for p, run_id in zip(payloads, run_ids, strict=True):
        if p.comm is None:
            continue
        for g in p.comm.groups:
            row = {
                "run_id": run_id,
                "rank": p.rank.rank,
                "group_name": g.group,
                "entered": g.entered,
                "completed": g.completed,
                "op": g.op,
                "since": g.since,
                "sampled_at": p.sent_at,
                "heartbeat": int(p.heartbeat),
                "idle_s": p.comm.idle_s,
            }
            key = (run_id, p.rank.rank, g.group)
            old = merged.get(key)
            if old is not None:
                row = {k: columns.merge_value(table.column(k).rule, old[k], v) for k, v in row.items()}
            merged[key] = row
    rows = [merged[k] for k in sorted(merged)]
    return {k: [row[k] for row in rows] for k in rows[0]} if rows else {}


def _link_samples(payloads: Sequence[IngestPayload], run_ids: Sequence[int]) -> Columns:
    """One ``link_samples`` row per (run, rank, batch's last step, connection); a key two
    batches of the group both carry keeps the later one (LAST)."""
    rows: dict[tuple[int, int, int, int, int], tuple[int, int, float, int]] = {}
    for p, run_id in zip(payloads, run_ids, strict=True):
        assert p.comm is not None
        n = len(p.steps.time_s)
        last = p.steps.first + n - 1
        for x in p.comm.links:
            rows[(run_id, p.rank.rank, last, x.local, x.peer)] = (x.bytes, x.received, x.busy_s, n)
    keys = sorted(rows)
    values = [rows[k] for k in keys]
    return {
        **{
            name: np.array([k[i] for k in keys], dtype=np.int64)
            for i, name in enumerate(("run_id", "rank", "step", "local_ep", "peer_ep"))
        },
        "bytes_sent": np.array([v[0] for v in values], dtype=np.int64),
        "bytes_received": np.array([v[1] for v in values], dtype=np.int64),
        "busy_s": np.array([v[2] for v in values], dtype=np.float64),
        "steps": np.array([v[3] for v in values], dtype=np.int64),
    }


def peer_wait(
    sync_s: npt.NDArray[np.float64], broadcast_s: npt.NDArray[np.float64] | None
) -> npt.NDArray[np.float64]:
    """Each step's wait for its peers, as staged (``step_timings.sync_s``; NaN: unknown):
    the wait at its last gradient bucket's all-reduce (``comm.sync_s``) plus its wait in
    DDP's buffer broadcast before the forward (``comm.broadcast_s``, NaN or absent: none
    measured, counted 0). A rank held in the broadcast by a late peer reaches the
    all-reduce late by as much, with a short sync; counted as the waiting it was, it is not
    taken for the rank the others waited for. NaN where the step had no gradient
    collective (its arrival is unknown)."""
    if broadcast_s is None:
        return sync_s
    return sync_s + np.where(np.isnan(broadcast_s), 0.0, broadcast_s)


def _step_timings(payloads: Sequence[IngestPayload], run_ids: Sequence[int]) -> Columns:
    """One ``step_timings`` row per (run, rank, batch) of the batches with a ``comm``
    section, its steps packed (``storage/packed.py``), keyed by its first step and
    ``sent_at`` (``columns.STEP_TIMINGS``; a key two batches of the group carry keeps the
    later one). The window's run-queue wait is shared among its steps in proportion to
    their time (a longer step, a checkpoint's, had longer to wait). A step's wait in DDP's
    buffer broadcast is added to its sync (:func:`peer_wait`): both are time spent waiting
    for peers in the step's collectives, and a rank held in the broadcast by a late peer is
    not late itself.

    Every batch's values are joined end to end and converted, combined and packed once
    for the group, each row a slice of the packed bytes: per batch, they were a dozen
    small numpy calls, more than the rest of the fold of a DDP rank's batch."""
    rows: dict[tuple[int, int, int, float], int] = {}  # key -> index of its batch
    n_l: list[int] = []
    time_l: list[float] = []
    wait_l: list[float] = []
    sync_l: list[float | None] = []
    cpu_l: list[float | None] = []
    held_of: list[Sequence[float | None] | None] = []  # absent from most batches
    unit_l: list[float] = []  # each batch's comm values per second
    share_l: list[float] = []  # each batch's run-queue wait per second of step time
    for i, (p, run_id) in enumerate(zip(payloads, run_ids, strict=True)):
        s, c = p.steps, p.comm
        assert c is not None
        n = len(s.time_s)
        n_l.append(n)
        time_l += s.time_s
        wait_l += s.data_wait_s
        unit, sync_sent, cpu_sent, held_sent = c.per_step()
        sync_l += sync_sent
        cpu_l += cpu_sent
        held_of.append(held_sent)
        unit_l.append(unit)
        # Python's sum, in step order (as the per-step staging shared it).
        total = sum(s.time_s)
        share_l.append(c.runq_s / total if c.runq_s is not None and total > 0 else np.nan)
        rows[(run_id, p.rank.rank, s.first, p.sent_at)] = i
    lengths = np.array(n_l, dtype=np.int64)
    t = np.array(time_l, dtype=np.float64)
    per_second = np.repeat(np.array(unit_l, dtype=np.float64), lengths)
    # ``None`` becomes NaN; microseconds / 1e6 is the float Python's ``v / 1e6`` gives.
    sync = np.array(sync_l, dtype=np.float64) / per_second
    held = None
    if any(x is not None for x in held_of):
        held_l: list[float | None] = []
        for x, n in zip(held_of, n_l, strict=True):
            held_l += x if x is not None else [None] * n
        held = np.array(held_l, dtype=np.float64) / per_second
    values = (
        t,
        np.array(wait_l, dtype=np.float64),
        peer_wait(sync, held),
        np.array(cpu_l, dtype=np.float64) / per_second,
        np.repeat(np.array(share_l, dtype=np.float64), lengths) * t,
    )
    blobs = [packed.pack(v) for v in values]
    ends = (np.cumsum(lengths) * packed.DTYPE.itemsize).tolist()
    keys = sorted(rows)
    chosen = [rows[k] for k in keys]
    bounds = [(ends[i] - n_l[i] * packed.DTYPE.itemsize, ends[i]) for i in chosen]
    return {
        "run_id": np.array([k[0] for k in keys], dtype=np.int64),
        "rank": np.array([k[1] for k in keys], dtype=np.int64),
        "first_step": np.array([k[2] for k in keys], dtype=np.int64),
        "sent_at": np.array([k[3] for k in keys], dtype=np.float64),
        "last_step": np.array([k[2] + n_l[i] - 1 for k, i in zip(keys, chosen, strict=True)], dtype=np.int64),
        **{
            name: [blob[a:b] for a, b in bounds]
            for name, blob in zip(columns.STEP_TIMING_VALUES, blobs, strict=True)
        },
    }


def _ranks(payloads: Sequence[IngestPayload], run_ids: Sequence[int]) -> Columns:
    # Batches of the same rank in one group merge by the rules of ``ranks``, in arrival
    # order, as successive upserts would.
    merged: dict[tuple[int, int], dict[str, Any]] = {}
    for p, run_id in zip(payloads, run_ids, strict=True):
        r, a, s = p.rank, p.agent, p.steps
        last = s.first + len(s.time_s) - 1
        row = {
            "run_id": run_id,
            "rank": r.rank,
            "host": r.host,
            "local_rank": r.local_rank,
            "coords": dict(r.coords),
            "last_step": last,
            "last_seen": datetime.fromtimestamp(s.wall_end, timezone.utc),
            "agent_version": a.version,
            "clock": a.clock,
            "dropped_windows": a.dropped_windows,
            "dropped_steps": a.dropped_steps,
            "hot_path_mean_s": a.hot_path_mean_s,
            "send_interval_s": a.send_interval_s,
            "final_step": last if p.final else None,
            # None (a heartbeat, an agent without profiler or older) keeps the stored value.
            "profiles_through": None if s.profiles_through is None else min(last, s.profiles_through),
        }
        old = merged.get((run_id, r.rank))
        if old is not None:
            row = {k: columns.merge_value(columns.RANKS.column(k).rule, old[k], v) for k, v in row.items()}
        merged[(run_id, r.rank)] = row
    rows = sorted(merged.values(), key=lambda x: (x["run_id"], x["rank"]))
    return {k: [row[k] for row in rows] for k in rows[0]} if rows else {}


def _fold_steps(
    payloads: Sequence[IngestPayload], run_ids: Sequence[int], window_steps: Sequence[int]
) -> tuple[Columns, Columns]:
    # One pass over the batches: their own values, and the per-step lists joined end to end
    # (list.extend runs at C speed). Padded tokens and tags, absent from most batches, are
    # built only when some batch has them.
    n_l: list[int] = []
    first_l: list[int] = []
    rank_l: list[int] = []
    end_l: list[float] = []
    counts_l: list[bool] = []
    time_l: list[float] = []
    wait_l: list[float] = []
    tok_l: list[int] = []
    padded_of: list[list[int] | None] = []
    tags_of: list[list[Tag] | None] = []
    for p in payloads:
        s = p.steps
        n_l.append(len(s.time_s))
        first_l.append(s.first)
        rank_l.append(p.rank.rank)
        end_l.append(s.wall_end)
        counts_l.append(p.rank.counts_tokens)
        time_l += s.time_s
        wait_l += s.data_wait_s
        tok_l += s.tokens
        padded_of.append(s.padded_tokens)
        tags_of.append(s.tags)
    lengths = np.array(n_l, dtype=np.int64)
    total = len(time_l)
    t = np.array(time_l, dtype=np.float64)
    wait = np.array(wait_l, dtype=np.float64)
    tokens = np.array(tok_l, dtype=np.int64)
    has_pad = np.repeat(np.array([x is not None for x in padded_of]), lengths)
    padded = np.zeros(total, dtype=np.int64)
    if has_pad.any():
        pad_l: list[int] = []
        for x, n in zip(padded_of, n_l, strict=True):
            pad_l += x if x is not None else [0] * n
        padded = np.array(pad_l, dtype=np.int64)
    tags = np.zeros(total, dtype=np.int16)
    if any(x is not None for x in tags_of):
        codes = wire.TAG_CODES
        tags = np.array(
            [codes.get(v or "", 0) for x, n in zip(tags_of, n_l, strict=True) for v in (x or [None] * n)],
            dtype=np.int16,
        )

    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    step = np.repeat(np.array(first_l, dtype=np.int64), lengths) + (
        np.arange(total) - np.repeat(starts, lengths)
    )
    run = np.repeat(np.array(run_ids, dtype=np.int64), lengths)
    rank = np.repeat(np.array(rank_l, dtype=np.int64), lengths)
    ws = np.repeat(np.array(window_steps, dtype=np.int64), lengths)
    window = columns.window_of(step, ws)
    batch_end = np.array(end_l, dtype=np.float64)
    # End of each step: its batch's end minus the durations of the later steps in the batch.
    later = np.cumsum(t[::-1])[::-1] - t  # suffix sums over the whole group...
    later -= np.repeat(later[starts + lengths - 1], lengths)  # ...minus the later batches'
    step_end = np.repeat(batch_end, lengths) - later
    counts = np.repeat(np.array(counts_l), lengths)

    # rank_windows: one row per (run, rank, window), each column folded by its rule.
    one = np.ones(total, dtype=np.int64)
    windows = _fold_windows(
        {
            "run_id": run,
            "rank": rank,
            "window": window,
            "first_step": step,
            "last_step": step,
            "n_steps": one,
            "step_time_sum": t,
            "step_time_min": t,
            "step_time_max": t,
            "data_wait_sum": wait,
            "tokens_sum": tokens,
            "padded_tokens_sum": np.ma.array(padded, mask=~has_pad),
            "wall_end": np.repeat(batch_end, lengths),
        },
        starts,
    )

    # job_steps: group by (run, step); only data-parallel leaders' tokens count.
    order, first_idx = _groups(run, step)
    job = columns.fold_table(
        columns.JOB_STEPS,
        {
            "run_id": run,
            "step": step,
            "ranks": one,
            "token_ranks": counts.astype(np.int64),
            "step_time_sum": t,
            "step_time_max": t,
            "data_wait_max": wait,
            "tokens": np.where(counts, tokens, 0),
            "padded_tokens": np.ma.array(np.where(counts, padded, 0), mask=~has_pad),
            "tag": tags,
            "wall_end": step_end,
        },
        order,
        first_idx,
    )
    return windows, job


def _fold_windows(sources: dict[str, npt.NDArray[Any]], starts: npt.NDArray[np.int64]) -> Columns:
    """``rank_windows`` rows of per-step ``sources`` whose batches begin at ``starts``.

    A batch is one rank's consecutive steps, so its steps of one window are adjacent: a
    row's steps are a run that begins where the batch or the window changes, folded in
    place with no sort of the steps, and only the rows are put in key order. Only when two
    batches of the group fall in the same (run, rank, window) (a backlog brought two of
    one rank's batches into one group) are the steps sorted by key first.
    """
    run, rank, window = sources["run_id"], sources["rank"], sources["window"]
    change = np.ones(len(window), dtype=bool)
    change[1:] = window[1:] != window[:-1]
    change[starts] = True
    first_idx = np.flatnonzero(change)
    keys = (run[first_idx], rank[first_idx], window[first_idx])
    rows = np.lexsort(keys[::-1])
    same = np.ones(len(rows) - 1, dtype=bool)
    for k in keys:
        ks = k[rows]
        same &= ks[1:] == ks[:-1]
    if same.any():
        order, first_idx = _groups(run, rank, window)
        return columns.fold_table(columns.RANK_WINDOWS, sources, order, first_idx)
    return {
        name: columns.reduce(columns.RANK_WINDOWS.column(name).rule, values, first_idx)[rows]
        for name, values in sources.items()
    }


def _groups(*keys: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]:
    """A stable sort by ``keys`` (first key most significant) and the index of the first
    element of each run of equal keys in that order."""
    order = np.lexsort(keys[::-1])
    change = np.zeros(len(order), dtype=bool)
    change[0] = True
    for k in keys:
        ks = k[order]
        change[1:] |= ks[1:] != ks[:-1]
    return order, np.flatnonzero(change)
