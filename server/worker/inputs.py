"""Reads for the analysis worker: runs to analyse, rank progress, windows and job samples.

Every query is bounded by an index: runs are found through ``ingested_batches``
(``run_id, received_at``), rank windows by a window range of the run (on PostgreSQL the
``(run_id, window)`` index, on SQLite a primary-key seek per rank: :func:`window_ranks`),
never a scan of the run's history, the staged per-step rows by a seek per rank
(:func:`staged_ranks`), job steps by ``(run_id, step)``. Rows become the analysis' plain
dataclasses here; nothing downstream sees SQLAlchemy.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from itertools import groupby
from operator import itemgetter
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
from sqlalchemy import (
    ARRAY,
    ColumnElement,
    Connection,
    Integer,
    Text,
    any_,
    cast,
    exists,
    func,
    literal,
    select,
)

from stepwatch import wire

from ..analysis.arrivals import RankSteps
from ..analysis.links import LinkSample
from ..analysis.pipeline import StepRow, tag_of
from ..analysis.robust import median
from ..analysis.stuck_collectives import GroupCounters
from ..analysis.types import RankWindow
from ..reads.runs import RunInfo, run_info
from ..storage import packed
from ..storage.backend import is_postgres
from ..storage.columns import STEP_TIMING_VALUES, window_of
from ..storage.engine import BINARY_RESULTS
from ..storage.models import IngestedBatch, Rank, RankGroup, Run, StepTiming, unix
from ..storage.models import JobStep as JobStepRow
from ..storage.models import LinkSample as LinkSampleRow
from ..storage.models import RankWindow as RankWindowRow
from .readiness import RankProgress

RUNS = Run.__table__
RANKS = Rank.__table__
RW = RankWindowRow.__table__
JS = JobStepRow.__table__
BATCHES = IngestedBatch.__table__
ST = StepTiming.__table__
RG = RankGroup.__table__
LS = LinkSampleRow.__table__
#: Ranks per read: an IN list stays under every backend's parameter limit (on PostgreSQL
#: a chunk is one array or one range, :func:`staged_ranks`, :func:`window_ranks`).
RANK_CHUNK = 2000


def window_ranks(conn: Connection, chunk: Sequence[int]) -> ColumnElement[bool]:
    """``rank_windows.rank IN chunk`` (a chunk of rank ids) for a read bounded by a
    window range. On PostgreSQL a chunk of consecutive ranks (a run's ranks are
    ``0..N-1`` in nearly every run) is written as a range: the planner bounds the read by
    the ``(run_id, window)`` index for both forms, the ranks a filter (EXPLAIN at 512
    ranks x 400 windows: 0.24 ms for the range, 0.21 ms for the IN list), and a range is
    two parameters where an IN list is one per rank, rendered by SQLAlchemy and parsed
    again by the driver at every execution (a statement that long is not cached). With
    the staged reads below that was 3.4% of a pass analysing new windows at 4,096 ranks
    (py-spy), 0.4% since. A chunk with a gap keeps the IN list (``= ANY`` of an array was
    searched row by row here: 1.3 ms), and so does SQLite, a seek per rank on the primary
    key (its planner might take a rank range there and read every window of those ranks)."""
    if is_postgres(conn) and chunk and max(chunk) - min(chunk) == len(chunk) - 1 == len(set(chunk)) - 1:
        return RW.c.rank.between(min(chunk), max(chunk))
    return RW.c.rank.in_(chunk)


def staged_ranks(conn: Connection, column: Any, chunk: Sequence[int]) -> ColumnElement[bool]:
    """``column IN chunk`` for the staged per-step tables (``step_timings``,
    ``link_samples``: primary key ``(run_id, rank, step)``), whose rows beyond the steps
    read are the backlog not yet analysed. On PostgreSQL one array parameter (``=
    ANY``): the same index condition as an IN list, a seek per rank to the steps read,
    without the list's rendering and parsing at every execution (see
    :func:`window_ranks`). Not a rank range: that reads every staged step of those ranks
    (measured with 800 staged steps per rank: a sequential scan, 116 ms against 5 ms)."""
    if is_postgres(conn):
        return column == any_(literal(list(chunk), ARRAY(Integer)))  # type: ignore[no-any-return]
    return column.in_(chunk)  # type: ignore[no-any-return]


class RankRow(NamedTuple):
    """A rank's identity and how far it has reported. A named tuple: one is built per
    rank per pass of every active run."""

    rank: int
    host: str
    local_rank: int
    coords: Mapping[str, int]
    last_step: int
    last_seen: float
    final_step: int | None
    profiles_through: int | None
    #: The readiness view of the same row (built with it: read several times per pass).
    progress: RankProgress


def active_runs(conn: Connection, since: datetime) -> list[RunInfo]:
    """Runs that received a batch since ``since`` (collector clock), oldest id first."""
    recent = exists().where(BATCHES.c.run_id == RUNS.c.id, BATCHES.c.received_at >= since)
    return [run_info(r) for r in conn.execute(select(RUNS).where(recent).order_by(RUNS.c.id))]


@lru_cache(maxsize=1 << 16)
def _coords(text: str | None) -> Mapping[str, int]:
    """A rank's stored coordinates, parsed once per distinct text (read-only: shared)."""
    return MappingProxyType(json.loads(text or "null") or {})


def rank_rows(conn: Connection, run_id: int) -> list[RankRow]:
    """Every rank of the run, read on each pass of every active run: its cost is paid
    per rank per pass (42 µs a rank at 4,096 ranks, most of the analysis worker's CPU
    under ingest, before the coordinates came as text parsed once per distinct value and
    the rows in one fetch)."""
    rows = conn.execute(
        select(
            RANKS.c.rank,
            RANKS.c.host,
            RANKS.c.local_rank,
            cast(RANKS.c.coords, Text),
            RANKS.c.last_step,
            RANKS.c.last_seen,
            RANKS.c.final_step,
            RANKS.c.profiles_through,
        )
        .where(RANKS.c.run_id == run_id)
        .order_by(RANKS.c.rank)
    ).all()
    return [
        RankRow(
            rank,
            host,
            local_rank,
            _coords(coords),
            last_step,
            unix(seen) or 0.0,
            final,
            profiles,
            RankProgress(rank, last_step, final, profiles),
        )
        for rank, host, local_rank, coords, last_step, seen, final, profiles in rows
    ]


def rank_fingerprint(conn: Connection, run_id: int) -> tuple[Any, ...]:
    """A value that changes whenever a rank row of the run does: each batch moves its
    rank's ``last_seen`` (a heartbeat moves nothing else), a window its ``last_step``, a
    final batch or a profile the other two. One aggregate in the database instead of
    every row in Python. (SQLite's ``extract`` has whole seconds: a rank reporting twice
    in one second may keep the first report's ``last_seen`` until its next change, a
    second's staleness against hang thresholds of a minute and more.)"""
    row = conn.execute(
        select(
            func.count(),
            func.sum(RANKS.c.last_step),
            func.sum(func.extract("epoch", RANKS.c.last_seen)),
            func.sum(func.coalesce(RANKS.c.final_step, -1)),
            func.sum(func.coalesce(RANKS.c.profiles_through, -1)),
        ).where(RANKS.c.run_id == run_id)
    ).one()
    return tuple(row)


#: Rank rows kept across passes (about 400 B each: some 100 MB): past it the runs read
#: least recently are dropped, and read again when next needed, as every pass did before.
MAX_KEPT_ROWS = 1 << 18


class RankReads:
    """The rank rows of each active run, read again only when they changed.

    Every pass needs every rank of every active run (readiness, hangs, captures); the
    rows change only when batches arrive, and between a run's windows, after it ends and
    for a week of horizon most passes find them as they were. The fingerprint is read
    before the rows (each read its own snapshot): a change between the two makes the
    next fingerprint differ, so it can cost a read, never hide a change."""

    def __init__(self, max_rows: int = MAX_KEPT_ROWS) -> None:
        self._max_rows = max_rows
        # Least recently used first (a run read or found unchanged moves to the end).
        self._rows: dict[int, tuple[tuple[Any, ...], tuple[RankRow, ...]]] = {}
        self._kept = 0  # rows held, over all runs

    def rows(self, conn: Connection, run_id: int) -> tuple[RankRow, ...]:
        fingerprint = rank_fingerprint(conn, run_id)
        held = self._drop(run_id)
        if held is None or held[0] != fingerprint:
            held = (fingerprint, tuple(rank_rows(conn, run_id)))
        self._rows[run_id] = held
        self._kept += len(held[1])
        while self._kept > self._max_rows and len(self._rows) > 1:
            self._drop(next(iter(self._rows)))
        return held[1]

    def keep(self, run_ids: Iterable[int]) -> None:
        """Forget the runs no longer active."""
        live = set(run_ids)
        for run_id in [r for r in self._rows if r not in live]:
            self._drop(run_id)

    def _drop(self, run_id: int) -> tuple[tuple[Any, ...], tuple[RankRow, ...]] | None:
        held = self._rows.pop(run_id, None)
        if held is not None:
            self._kept -= len(held[1])
        return held


def group_counters(conn: Connection, run_id: int) -> list[GroupCounters]:
    """Every rank's latest collective counters per process group (read only when a
    rank is silent past the hang threshold: a seek on the primary key's run prefix)."""
    rows = conn.execute(
        select(
            RG.c.rank,
            RG.c.group_name,
            RG.c.entered,
            RG.c.completed,
            RG.c.op,
            RG.c.since,
            RG.c.heartbeat,
            RG.c.idle_s,
        )
        .where(RG.c.run_id == run_id)
        .order_by(RG.c.rank, RG.c.group_name)
    )
    return [
        GroupCounters(
            r.rank, r.group_name, r.entered, r.completed, r.op, r.since, bool(r.heartbeat), r.idle_s or 0.0
        )
        for r in rows
    ]


def max_step(conn: Connection, run_id: int) -> int:
    """The largest step any rank reported (0 before the first)."""
    value = conn.execute(select(func.max(JS.c.step)).where(JS.c.run_id == run_id)).scalar()
    return int(value or 0)


def recent_step_time(conn: Connection, run_id: int, n: int = 64) -> float | None:
    """Median job step time of the latest ``n`` untagged steps (for the hang threshold)."""
    q = (
        select(JS.c.step_time_sum / JS.c.ranks)
        .where(JS.c.run_id == run_id, JS.c.tag == 0, JS.c.ranks > 0, JS.c.step_time_sum > 0)
        .order_by(JS.c.step.desc())
        .limit(n)
    )
    values = [float(v) for (v,) in conn.execute(q)]
    return median(values) if values else None


def comm_groups(coords: Mapping[str, int], layout: Mapping[str, int]) -> dict[str, str]:
    """Communicator group ids of a rank, keyed by type; empty in pure data parallel.

    The group of type X holds the ranks that agree on every coordinate but X, so the ids
    name those coordinates (``dp:tp1:cp0:pp0``). Types of size 1 have no group.
    """
    dims = ("dp", "tp", "cp", "pp")
    if all(int(layout.get(d, 1)) <= 1 for d in ("tp", "cp", "pp")):
        return {}
    out: dict[str, str] = {}
    for gtype in dims:
        if int(layout.get(gtype, 1)) > 1:
            others = ":".join(f"{d}{int(coords.get(d, 0))}" for d in dims if d != gtype)
            out[gtype] = f"{gtype}:{others}"
    return out


def rank_windows(
    conn: Connection, run: RunInfo, ranks: Sequence[RankRow], first: int, last: int
) -> dict[int, list[RankWindow]]:
    """Rank windows ``first..last`` of a run, by window index, as the detectors' type."""
    by_rank = {r.rank: r for r in ranks}
    layout = dict(run.layout)
    model_parallel = any(int(layout.get(d, 1)) > 1 for d in ("tp", "cp", "pp"))
    out: dict[int, list[RankWindow]] = {}
    ids = sorted(by_rank)
    for i in range(0, len(ids), RANK_CHUNK):
        chunk = ids[i : i + RANK_CHUNK]
        rows = conn.execute(
            select(RW)
            .where(
                RW.c.run_id == run.id,
                window_ranks(conn, chunk),
                RW.c.window >= first,
                RW.c.window <= last,
            )
            .execution_options(**{BINARY_RESULTS: True})  # numbers unparsed: half the read's CPU
        )
        for row in rows:
            if row.n_steps <= 0:
                continue
            who = by_rank[row.rank]
            n = float(row.n_steps)
            profiled = row.profiled_steps is not None and row.compute_s is not None
            groups = comm_groups(who.coords, layout)
            transfer = dict(row.group_transfer_s or {}) if profiled else {}
            out.setdefault(row.window, []).append(
                RankWindow(
                    run=run.name,
                    rank=row.rank,
                    host=who.host,
                    local_rank=who.local_rank,
                    window=row.window,
                    first_step=row.first_step,
                    last_step=row.last_step,
                    n_steps=row.n_steps,
                    step_time_s=row.step_time_sum / n,
                    data_wait_s=row.data_wait_sum / n,
                    compute_s=row.compute_s if profiled else None,
                    comm_exposed_s=row.comm_exposed_s if profiled else None,
                    comm_overlapped_s=row.comm_overlapped_s if profiled else None,
                    idle_s=row.idle_s if profiled else None,
                    comm_wait_s=row.comm_wait_s if profiled else None,
                    comm_transfer_s=row.comm_transfer_s if profiled else None,
                    dp_rank=int(who.coords.get("dp", 0)) if model_parallel else None,
                    tp_rank=int(who.coords.get("tp", 0)) if model_parallel else None,
                    pp_rank=int(who.coords.get("pp", 0)) if model_parallel else None,
                    cp_rank=int(who.coords.get("cp", 0)) if model_parallel else None,
                    groups=groups,
                    group_transfer_s={k: float(v) for k, v in transfer.items() if k in groups},
                )
            )
    for windows in out.values():
        windows.sort(key=lambda w: w.rank)
    return out


def job_steps(conn: Connection, run: RunInfo, first: int, last: int) -> dict[int, list[StepRow]]:
    """Job step rows of windows ``first..last``, by window index.

    Global tokens of a step are the reporting replicas' tokens scaled to all replicas,
    and step time the mean over the ranks that reported it, as in the read API.
    """
    ws = run.window_steps
    rows = conn.execute(
        select(
            JS.c.step, JS.c.ranks, JS.c.token_ranks, JS.c.step_time_sum, JS.c.tokens, JS.c.tag, JS.c.wall_end
        )
        .where(JS.c.run_id == run.id, JS.c.step >= first * ws + 1, JS.c.step <= (last + 1) * ws)
        .order_by(JS.c.step)
    )
    steps: dict[int, list[StepRow]] = {}
    for r in rows:
        if r.ranks <= 0:
            continue
        tokens = float(r.tokens) * run.dp_size / r.token_ranks if r.token_ranks > 0 else 0.0
        steps.setdefault(window_of(r.step, ws), []).append(
            StepRow(
                step=r.step,
                step_time_s=r.step_time_sum / r.ranks,
                tokens=tokens,
                tag=tag_of(r.tag, wire.TAGS),
                wall_end=float(r.wall_end),
            )
        )
    return steps


def step_timings(
    conn: Connection, run: RunInfo, ranks: Sequence[RankRow], first: int, last: int
) -> dict[int, list[RankSteps]]:
    """Staged per-step collective timing of windows ``first..last``, by window index: per
    window, one :class:`RankSteps` per rank that sent timing for it, in rank order (a
    seek per rank).

    Steps the agent tagged (warm-up, checkpoint, evaluation) are left out, unmeasured:
    they are not the run's steady pace (the regression detector skips them too), and a
    rank that saves the checkpoint, or starts last, arrives late there for a reason the
    user has named (a clean real run flagged rank 3 a host stall over its warm-up)."""
    ws = run.window_steps
    lo, hi = first * ws + 1, (last + 1) * ws
    tagged = set(
        conn.execute(
            select(JS.c.step).where(JS.c.run_id == run.id, JS.c.step.between(lo, hi), JS.c.tag != 0)
        ).scalars()
    )
    hosts = {r.rank: r.host for r in ranks}
    out: dict[int, list[RankSteps]] = {}
    for rank, steps, cols in _staged_series(conn, run.id, sorted(hosts), lo, hi):
        if tagged and not tagged.isdisjoint(steps):
            keep = [j for j, step in enumerate(steps) if step not in tagged]
            steps, cols = [steps[j] for j in keep], [c[keep] for c in cols]
        j = 0
        while j < len(steps):  # the steps of one window at a time (they are sorted)
            w = window_of(steps[j], ws)
            end = bisect_right(steps, (w + 1) * ws, j)
            out.setdefault(w, []).append(
                _rank_steps(rank, hosts[rank], steps[j:end], [c[j:end] for c in cols])
            )
            j = end
    return {w: out[w] for w in sorted(out)}


def _staged_series(
    conn: Connection, run_id: int, ids: Sequence[int], lo: int, hi: int
) -> Iterator[tuple[int, list[int], list[npt.NDArray[np.float64]]]]:
    """Each rank's staged steps ``lo..hi`` in step order, with the
    :data:`~..storage.columns.STEP_TIMING_VALUES` of those steps (NaN where unknown), in
    rank order: the rank's batches (rows, their steps packed) that hold any of those steps.
    A row per batch, not per step: reading a 4,096-rank window was a row per rank and step
    (on PostgreSQL aggregated into arrays per rank by the server, ``array_agg``)."""
    for i in range(0, len(ids), RANK_CHUNK):
        rows = conn.execute(
            select(ST.c.rank, ST.c.first_step, ST.c.sent_at, *(ST.c[k] for k in STEP_TIMING_VALUES))
            .where(
                ST.c.run_id == run_id,
                staged_ranks(conn, ST.c.rank, ids[i : i + RANK_CHUNK]),
                ST.c.first_step <= hi,
                ST.c.last_step >= lo,
            )
            .order_by(ST.c.rank, ST.c.first_step)
            .execution_options(**{BINARY_RESULTS: True})  # the packed columns as stored
        )
        for rank, batches in groupby(rows, key=itemgetter(0)):
            steps, cols = _unpacked([b[1:] for b in batches], lo, hi)
            yield rank, steps, cols


def _unpacked(
    batches: Sequence[Sequence[Any]], lo: int, hi: int
) -> tuple[list[int], list[npt.NDArray[np.float64]]]:
    """One rank's batches ``(first_step, sent_at, *packed columns)``, in step order, as its
    steps ``lo..hi`` and their values (float64, NaN where unknown: what the arrivals' line-up
    reads, without a list of Python floats and Nones in between). Where two batches carry a step
    (an agent restarted from a checkpoint sends steps again under new batch ids) the one
    sent later holds it (``columns.STEP_TIMINGS``)."""
    n_cols = len(STEP_TIMING_VALUES)
    spans: list[tuple[int, float, list[npt.NDArray[np.float64]]]] = []
    for first, sent_at, *blobs in batches:
        values = [packed.unpack(b) for b in blobs]
        a, b = max(first, lo), min(first + len(values[0]) - 1, hi)
        spans.append((a, sent_at, [v[a - first : b - first + 1] for v in values]))
    ends = [a + len(vs[0]) - 1 for a, _, vs in spans]
    if all(spans[k + 1][0] > ends[k] for k in range(len(spans) - 1)):  # no step twice (nearly always)
        steps = [step for (a, _, vs), end in zip(spans, ends, strict=True) for step in range(a, end + 1)]
        cols = [np.concatenate([vs[k] for _, _, vs in spans]) for k in range(n_cols)]
    else:
        held: dict[int, list[float]] = {}
        for a, _, vs in sorted(spans, key=itemgetter(1)):  # the later sent overwrites
            for j, row in enumerate(zip(*(v.tolist() for v in vs), strict=True)):
                held[a + j] = list(row)
        steps = sorted(held)
        cols = [np.array([held[s][k] for s in steps], dtype=np.float64) for k in range(n_cols)]
    return steps, cols


def _rank_steps(rank: int, host: str, steps: list[int], cols: list[npt.NDArray[np.float64]]) -> RankSteps:
    """One rank's steps of one window as :class:`RankSteps`; steps a rank did not report
    stay unmeasured (NaN, step time and data wait 0), so steps keep their places."""
    first_step, n = steps[0], steps[-1] - steps[0] + 1
    if n == len(steps):  # every step reported (nearly always): the columns as they are
        return RankSteps(rank, host, first_step, *cols)
    at = np.array(steps, dtype=np.int64) - first_step
    filled = []
    for k, c in enumerate(cols):
        full = np.zeros(n) if k < 2 else np.full(n, np.nan)  # step time, data wait: 0
        full[at] = c
        filled.append(full)
    return RankSteps(rank, host, first_step, *filled)


def link_samples(
    conn: Connection, run: RunInfo, ranks: Sequence[RankRow], first: int, last: int
) -> dict[int, list[LinkSample]]:
    """Staged link samples of windows ``first..last``, by window index (a batch's sample
    belongs to the window of the batch's last step); a seek per chunk of ranks."""
    ws = run.window_steps
    lo, hi = first * ws + 1, (last + 1) * ws
    ids = sorted({r.rank for r in ranks})
    out: dict[int, list[LinkSample]] = {}
    for i in range(0, len(ids), RANK_CHUNK):
        rows = conn.execute(
            select(
                LS.c.rank,
                LS.c.step,
                LS.c.local_ep,
                LS.c.peer_ep,
                LS.c.bytes_sent,
                LS.c.bytes_received,
                LS.c.busy_s,
                LS.c.steps,
            )
            .where(
                LS.c.run_id == run.id,
                staged_ranks(conn, LS.c.rank, ids[i : i + RANK_CHUNK]),
                LS.c.step.between(lo, hi),
            )
            .order_by(LS.c.rank, LS.c.step)
            .execution_options(**{BINARY_RESULTS: True})
        )
        for r in rows:
            out.setdefault(window_of(r.step, ws), []).append(
                LinkSample(r.rank, r.local_ep, r.peer_ep, r.bytes_sent, r.bytes_received, r.busy_s, r.steps)
            )
    return out


def peer_groups(ranks: Sequence[RankRow]) -> dict[int, tuple[int, int, int]]:
    """Each rank's peer group: the data-parallel replicas of one (pipeline stage, tensor
    rank, context rank) cell do the same work and meet in the same gradient all-reduce;
    in pure data parallel every rank has the key (0, 0, 0)."""
    return {
        r.rank: (int(r.coords.get("pp", 0)), int(r.coords.get("tp", 0)), int(r.coords.get("cp", 0)))
        for r in ranks
    }


def by_group(
    series: Sequence[RankSteps], peer_of: Mapping[int, tuple[int, int, int]]
) -> list[list[RankSteps]]:
    """One window's ranks split into peer groups (ordered by group key)."""
    groups: dict[tuple[int, int, int], list[RankSteps]] = {}
    for s in series:
        groups.setdefault(peer_of.get(s.rank, (0, 0, 0)), []).append(s)
    return [groups[k] for k in sorted(groups)]
