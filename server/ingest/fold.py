"""Fold a group of validated batches into the rows that ingest merges into the database.

Pure functions over plain data (no database): a group of batches becomes one row per
(run, rank) for ``ranks``, one per (run, rank, window) for ``rank_windows`` and one per
(run, step) for ``job_steps``, each already summed over the group, so the database
merges a few hundred rows instead of one per rank-step. The per-step work is vectorised
with numpy (sort by key, then ``reduceat``): at 4,096 ranks it is the collector's hot
loop, and a Python loop over every rank-step cost more than the database itself.

The merge rules are the ones the upserts apply between groups: counts and sums add,
minima and maxima stay extreme, a padded-token sum is null only if no step had one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import numpy as np
import numpy.typing as npt

from ..schemas import IngestPayload

TAG_CODES = {"warmup": 1, "checkpoint": 2, "eval": 3}
#: Column name -> values: a list (``ranks``) or a numpy array (masked where NULL).
Columns = dict[str, Any]


@dataclass(frozen=True)
class Rows:
    """Column-oriented rows for the three tables: numpy arrays for the step-derived tables
    (sent to PostgreSQL in binary), lists for ``ranks``."""

    ranks: Columns
    windows: Columns
    job_steps: Columns


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
    return Rows(ranks=_ranks(payloads, run_ids), windows=windows, job_steps=job_steps)


def _ranks(payloads: Sequence[IngestPayload], run_ids: Sequence[int]) -> Columns:
    # Batches of the same rank in one group: counters keep their maximum, the latest
    # batch (in arrival order) names the host and version, a final step once known stays,
    # as successive upserts would.
    merged: dict[tuple[int, int], dict[str, Any]] = {}
    for p, run_id in zip(payloads, run_ids, strict=True):
        r, a, s = p.rank, p.agent, p.steps
        row = {
            "run_id": run_id,
            "rank": r.rank,
            "host": r.host,
            "local_rank": r.local_rank,
            "coords": dict(r.coords),
            "last_step": s.first + len(s.time_s) - 1,
            "last_seen": datetime.fromtimestamp(s.wall_end, timezone.utc),
            "agent_version": a.version,
            "clock": a.clock,
            "dropped_windows": a.dropped_windows,
            "dropped_steps": a.dropped_steps,
            "hot_path_mean_s": a.hot_path_mean_s,
            "final_step": s.first + len(s.time_s) - 1 if p.final else None,
        }
        old = merged.get((run_id, r.rank))
        if old is not None:
            for k in ("last_step", "last_seen", "dropped_windows", "dropped_steps"):
                row[k] = max(row[k], old[k])
            for k in ("hot_path_mean_s", "final_step"):
                if row[k] is None:
                    row[k] = old[k]
        merged[(run_id, r.rank)] = row
    rows = sorted(merged.values(), key=lambda x: (x["run_id"], x["rank"]))
    return {k: [row[k] for row in rows] for k in rows[0]} if rows else {}


def _fold_steps(
    payloads: Sequence[IngestPayload], run_ids: Sequence[int], window_steps: Sequence[int]
) -> tuple[Columns, Columns]:
    lengths = np.array([len(p.steps.time_s) for p in payloads], dtype=np.int64)
    total = int(lengths.sum())
    # Flat per-step columns over the whole group (list.extend runs at C speed).
    time_l: list[float] = []
    wait_l: list[float] = []
    tok_l: list[int] = []
    pad_l: list[int] = []
    tag_l: list[int] = []
    has_pad = np.repeat(np.array([p.steps.padded_tokens is not None for p in payloads]), lengths)
    for p in payloads:
        s = p.steps
        n = len(s.time_s)
        time_l += s.time_s
        wait_l += s.data_wait_s
        tok_l += s.tokens
        pad_l += s.padded_tokens if s.padded_tokens is not None else [0] * n
        tag_l += [TAG_CODES.get(t or "", 0) for t in s.tags] if s.tags is not None else [0] * n
    t = np.array(time_l, dtype=np.float64)
    wait = np.array(wait_l, dtype=np.float64)
    tokens = np.array(tok_l, dtype=np.int64)
    padded = np.array(pad_l, dtype=np.int64)
    tags = np.array(tag_l, dtype=np.int16)

    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    firsts = np.array([p.steps.first for p in payloads], dtype=np.int64)
    step = np.repeat(firsts, lengths) + (np.arange(total) - np.repeat(starts, lengths))
    run = np.repeat(np.array(run_ids, dtype=np.int64), lengths)
    rank = np.repeat(np.array([p.rank.rank for p in payloads], dtype=np.int64), lengths)
    ws = np.repeat(np.array(window_steps, dtype=np.int64), lengths)
    window = np.where(step > 0, (step - 1) // ws, 0)
    batch_end = np.array([p.steps.wall_end for p in payloads], dtype=np.float64)
    # End of each step: its batch's end minus the durations of the later steps in the batch.
    later = np.cumsum(t[::-1])[::-1] - t  # suffix sums over the whole group...
    later -= np.repeat(later[starts + lengths - 1], lengths)  # ...minus the later batches'
    step_end = np.repeat(batch_end, lengths) - later
    counts = np.repeat(np.array([p.rank.counts_tokens for p in payloads]), lengths)

    # rank_windows: group by (run, rank, window).
    order, first_idx = _groups(run, rank, window)
    windows: Columns = {
        "run_id": run[order][first_idx],
        "rank": rank[order][first_idx],
        "window": window[order][first_idx],
        "first_step": np.minimum.reduceat(step[order], first_idx),
        "last_step": np.maximum.reduceat(step[order], first_idx),
        "n_steps": np.diff(np.append(first_idx, total)),
        "step_time_sum": np.add.reduceat(t[order], first_idx),
        "step_time_min": np.minimum.reduceat(t[order], first_idx),
        "step_time_max": np.maximum.reduceat(t[order], first_idx),
        "data_wait_sum": np.add.reduceat(wait[order], first_idx),
        "tokens_sum": np.add.reduceat(tokens[order], first_idx),
        "padded_tokens_sum": _nullable_sum(padded[order], has_pad[order], first_idx),
        "wall_end": np.maximum.reduceat(np.repeat(batch_end, lengths)[order], first_idx),
    }

    # job_steps: group by (run, step); only data-parallel leaders' tokens count.
    order, first_idx = _groups(run, step)
    c = counts[order]
    pad_counted = np.where(c, padded[order], 0)
    job: Columns = {
        "run_id": run[order][first_idx],
        "step": step[order][first_idx],
        "ranks": np.diff(np.append(first_idx, total)),
        "token_ranks": np.add.reduceat(c.astype(np.int64), first_idx),
        "step_time_sum": np.add.reduceat(t[order], first_idx),
        "step_time_max": np.maximum.reduceat(t[order], first_idx),
        "data_wait_max": np.maximum.reduceat(wait[order], first_idx),
        "tokens": np.add.reduceat(np.where(c, tokens[order], 0), first_idx),
        "padded_tokens": _nullable_sum(pad_counted, has_pad[order], first_idx),
        "tag": np.maximum.reduceat(tags[order], first_idx),
        "wall_end": np.maximum.reduceat(step_end[order], first_idx),
    }
    return windows, job


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


def _nullable_sum(
    values: npt.NDArray[np.int64], present: npt.NDArray[np.bool_], first_idx: npt.NDArray[np.intp]
) -> np.ma.MaskedArray[Any, np.dtype[np.int64]]:
    sums = np.add.reduceat(np.where(present, values, 0), first_idx)
    return np.ma.array(sums, mask=~np.logical_or.reduceat(present, first_idx))
