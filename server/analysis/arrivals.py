"""Who arrived last, step by step: wait/transfer and late-arrival stragglers from the
always-on collective timing (the agent's ``comm`` section), for every window.

Why per step and paired: on a 4-rank group a window holds a handful of steps, and a
median of 4 with a MAD of 3 moves with one noisy rank. Comparing each rank with the
median of its *other* peers within the same step (a paired difference) removes what the
step shares (a slow batch, a GC pause on every rank, CPU contention), and a sign test over
the window's steps asks "is this rank late on almost every step?", which holds for 4 peers
and for 16,384 alike (the leave-one-out median converges to the median).

No shared clock is needed. A collective ends at about the same moment on every rank of
its group, so each rank's ``sync`` (end of its last bucket's all-reduce minus that
bucket's arrival, on its own clock) lines the ranks up: per step, ``transfer`` = the
smallest sync (the last arriver waited for nobody) and ``wait`` = sync - transfer.

Causes are named for what was measured on the late rank, per step, against its peers'
median: extra data-loader wait explains it (``data``), extra training-thread CPU explains
it on most of the window's steps (``compute``: the median step's and a sign test's, as for
the lateness; a median just over the threshold on half the steps was a healthy rank
beside a CPU burner in the demo), extra run-queue wait of the training thread explains it
(``cpu_contention``: it was runnable but the host's cores were busy with other work, the
Linux schedstat the agent reads per window), none does (``host_stall``: the host sat
idle, a sleep, a slow callback, a blocking call). Ranks of one host late together make a
``host`` finding.

Pure functions over plain data (numpy arrays in, dataclasses out).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from numpy.typing import NDArray

ArrivalCause = Literal["compute", "host_stall", "data", "host", "cpu_contention"]
Matrix = NDArray[np.float64]
#: A rank's values per step: a list (None where not measured) or, as the worker reads
#: them from the staged rows, float64 (NaN where not measured).
Values = Sequence[float | None] | NDArray[np.float64]

#: Exact leave-one-out medians up to this many ranks; above it the group median (the
#: difference is below one rank's weight, 1/n).
EXACT_LOO_RANKS = 64


@dataclass(frozen=True, slots=True)
class RankSteps:
    """One rank's per-step timing in one window (seconds; None or NaN where not measured).

    ``sync_s``: end of the last bucket's collective minus its arrival; ``cpu_s``:
    training-thread CPU time of the step; ``data_wait_s``: host blocked in the loader;
    ``runq_s``: training-thread run-queue wait, its window's shared by step time (empty,
    ``None`` or NaN: not measured).
    """

    rank: int
    host: str
    first_step: int
    step_time_s: Values
    data_wait_s: Values
    sync_s: Values
    cpu_s: Values
    runq_s: Values = ()


@dataclass(frozen=True, slots=True)
class Aligned:
    """A group's window lined up by step: rows are steps, columns ranks (``ranks``)."""

    ranks: tuple[int, ...]
    hosts: tuple[str, ...]
    steps: tuple[int, ...]
    step_time: Matrix
    wait: Matrix  # last arrival - own arrival
    transfer: Matrix  # end - last arrival (the same for every rank of a step)
    cpu: Matrix
    data_wait: Matrix
    runq: Matrix


def _col(values: Values, first: int, steps: NDArray[np.int64]) -> NDArray[np.float64]:
    """A rank's values at ``steps`` (its first value is step ``first``), NaN where it has
    none. Vectorised: a Python loop over every rank and step of a window was most of a
    4,096-rank pass's line-up."""
    have = np.asarray(values, dtype=np.float64)  # None -> NaN; the worker's arrays as they are
    j = steps - first
    ok = (j >= 0) & (j < len(have))
    out = np.full(len(steps), np.nan)
    out[ok] = have[j[ok]]
    return out


def line_up(ranks: Sequence[RankSteps]) -> Aligned:
    """Steps every rank reported, with wait and transfer per step and rank.

    A step where some rank has no sync (no collective, or its timing was lost) is dropped:
    the last arrival of that step is unknown.
    """
    if not ranks:
        raise ValueError("line_up needs at least one rank")
    ordered = sorted(ranks, key=lambda r: r.rank)
    first, n = ordered[0].first_step, len(ordered[0].sync_s)
    # Nearly always every rank reported the same steps: then each column is the ranks'
    # values stacked in one call, where a set of steps and a column per rank, at 4,096
    # ranks, were most of a pass's line-up.
    same = all(r.first_step == first and len(r.sync_s) == n for r in ordered)
    if same:
        steps = list(range(first, first + n))
    else:
        common = set(range(first, first + n))
        for r in ordered[1:]:
            common &= set(range(r.first_step, r.first_step + len(r.sync_s)))
        steps = sorted(common)
    at = np.array(steps, dtype=np.int64)

    def matrix(name: str, rows: NDArray[np.int64]) -> Matrix:
        """Steps ``rows`` by ranks of column ``name``, NaN where a rank has no value."""
        values = [getattr(r, name) for r in ordered]
        if same and len(rows) == n and all(len(v) == n for v in values):
            return np.ascontiguousarray(np.array(values, dtype=np.float64).T)  # None -> NaN
        return np.column_stack([_col(v, r.first_step, rows) for v, r in zip(values, ordered, strict=True)])

    sync = matrix("sync_s", at) if steps else np.empty((0, len(ordered)))
    keep: NDArray[np.bool_] = np.asarray(~np.isnan(sync).any(axis=1), dtype=bool)
    sync = sync[keep]
    kept = tuple(s for s, k in zip(steps, keep.tolist(), strict=True) if k)
    kept_at = at[keep]

    def cols(name: str) -> Matrix:
        if not kept:
            return np.empty((0, len(ordered)))
        if len(kept) < n and same:  # the whole window stacked, then the steps kept
            return matrix(name, at)[keep]
        return matrix(name, kept_at)

    transfer = sync.min(axis=1, keepdims=True) if len(kept) else np.empty((0, 1))
    return Aligned(
        ranks=tuple(r.rank for r in ordered),
        hosts=tuple(r.host for r in ordered),
        steps=kept,
        step_time=cols("step_time_s"),
        wait=sync - transfer,
        transfer=np.broadcast_to(transfer, sync.shape).copy(),
        cpu=cols("cpu_s"),
        data_wait=cols("data_wait_s"),
        runq=cols("runq_s"),
    )


def stack(first: Aligned, then: Aligned) -> Aligned:
    """Two line-ups of the same ranks, one after the other: the steps of consecutive
    windows pooled into one test (each step keeps its own wait, transfer and CPU)."""
    if first.ranks != then.ranks:
        raise ValueError(f"cannot pool ranks {then.ranks} after ranks {first.ranks}")
    return Aligned(
        ranks=first.ranks,
        hosts=then.hosts,
        steps=first.steps + then.steps,
        step_time=np.vstack([first.step_time, then.step_time]),
        wait=np.vstack([first.wait, then.wait]),
        transfer=np.vstack([first.transfer, then.transfer]),
        cpu=np.vstack([first.cpu, then.cpu]),
        data_wait=np.vstack([first.data_wait, then.data_wait]),
        runq=np.vstack([first.runq, then.runq]),
    )


def loo_median(m: Matrix) -> Matrix:
    """Per row, each column's leave-one-out median (the median of the other columns)."""
    n = m.shape[1]
    if n < 2:
        return np.full_like(m, np.nan)
    if n > EXACT_LOO_RANKS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return np.broadcast_to(np.nanmedian(m, axis=1, keepdims=True), m.shape).copy()
    out = np.empty_like(m)
    with warnings.catch_warnings():  # a step no peer measured gives NaN, which is meant
        warnings.simplefilter("ignore", RuntimeWarning)
        for i in range(n):
            out[:, i] = np.nanmedian(np.delete(m, i, axis=1), axis=1)
    return out


@functools.lru_cache(maxsize=65536)
def sign_test_p(positive: int, negative: int) -> float:
    """One-sided sign-test p-value: P(at least ``positive`` of the non-tied steps are
    positive) when each is positive with probability 1/2. Cached: a pass asks it twice
    per rank, always about the few counts a window's steps can give."""
    n = positive + negative
    if n == 0:
        return 1.0
    return sum(math.comb(n, k) for k in range(positive, n + 1)) / 2.0**n


@dataclass(frozen=True, slots=True)
class Config:
    #: Lateness (peers' wait minus own wait) below this share of the step is noise.
    min_share: float = 0.05
    #: ... and below this many seconds (clock resolution, callback jitter).
    min_seconds: float = 1e-3
    #: Largest sign-test p-value that counts as late in one window (6 of 8 steps, 4 of 4):
    #: on a busy host other ranks arrive last now and then; the flag needs persistence
    #: (:func:`persistent`) on top, which keeps clean runs quiet.
    max_p: float = 0.15
    #: Share of the lateness that extra loader wait must explain to name ``data``.
    explain: float = 0.5
    #: Extra training-thread CPU, as a share of the peers', that names ``compute``. Not a
    #: share of the lateness: on a busy host a rank gets part of a core, so extra work
    #: costs more wall time than CPU time; a stalled host adds wall time and no CPU.
    extra_cpu: float = 0.1
    #: Share of the lateness that extra run-queue wait must explain to name
    #: ``cpu_contention`` rather than ``host_stall`` (a rank waiting for a core is
    #: runnable; a stalled one is not).
    explain_runq: float = 0.5
    #: Ranks of one host that must be late (and share of its ranks) for a host finding.
    host_min_ranks: int = 2
    host_fraction: float = 0.75
    #: Steps of a test on which a late rank may be beaten to the collective by another
    #: (a scheduler hop on a busy host) and still be found late.
    misses: int = 2

    @property
    def min_steps(self) -> int:
        """Fewest steps one test must hold: the least ``n`` at which ``n - misses`` late
        steps of ``n`` pass the sign test at ``max_p`` (8 at the defaults: 6 of 8 gives
        p = 0.145, 5 of 7 only 0.227). Fewer steps cannot name a rank that misses
        ``misses`` of them whatever its lateness (a 2-step window: never, 2 of 2 is
        p = 0.25), so the detector pools consecutive windows up to this many steps."""
        n = self.misses + 1
        while sign_test_p(n - self.misses, self.misses) > self.max_p:
            n += 1
        return n


@dataclass(frozen=True, slots=True)
class LateRank:
    """A rank its peers waited for in one window, with the evidence."""

    rank: int
    host: str
    cause: ArrivalCause
    lateness_s: float  # median per step of peers' wait minus own wait
    share: float  # lateness over the median step time
    late_steps: int
    steps: int
    p_value: float
    evidence: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class HostFinding:
    host: str
    ranks: tuple[int, ...]
    cause: ArrivalCause  # what made its ranks late
    lateness_s: float


def late_ranks(a: Aligned, cfg: Config = Config()) -> list[LateRank]:
    """Ranks that arrive last on most steps of the window, each with its cause."""
    n_steps, n = a.wait.shape
    if n < 2 or n_steps == 0:
        return []
    # Per step: how much later than its peers this rank arrived (paired, leave-one-out).
    peer_wait = loo_median(a.wait)
    late = peer_wait - a.wait
    step_ref = float(np.nanmedian(a.step_time))
    tau = max(cfg.min_seconds, cfg.min_share * step_ref)
    peer_cpu_all = loo_median(a.cpu)
    extra_cpu = a.cpu - peer_cpu_all
    extra_data = a.data_wait - loo_median(a.data_wait)
    extra_runq = a.runq - loo_median(a.runq)
    # The tests that screen every rank, for all ranks at once (the same values as column
    # by column): a dozen numpy calls per rank were most of a 4,096-rank pass's detector.
    # Only the few ranks they keep are looked at one by one.
    loader_bound = [
        sign_test_p(pos, neg) <= cfg.max_p
        for pos, neg in zip(
            np.sum(extra_data > tau, axis=0).tolist(), np.sum(extra_data <= tau, axis=0).tolist(), strict=True
        )
    ]
    # Loader wait is measured on the rank itself: no need to see it arrive last (a
    # sleeping loader frees its core, and its peers then lose part of the lead).
    lates = np.where(np.array(loader_bound, dtype=bool), np.maximum(late, extra_data), late)
    # The sign of each step's paired difference (late at all), the size on the median: a
    # sleeping rank frees its core, so its peers catch up part of its lateness.
    positive = np.sum(lates > cfg.min_seconds, axis=0).tolist()
    negative = np.sum(lates <= cfg.min_seconds, axis=0).tolist()
    medians = np.median(lates, axis=0).tolist()
    # On a busy host the scheduler makes every rank late now and then, so the sign of the
    # lateness is noisy; extra CPU on (almost) every step is not: a rank late on the median
    # step that does more work than its peers on most steps is late too.
    valid = ~np.isnan(extra_cpu)
    more = valid & (extra_cpu > np.maximum(cfg.min_seconds, cfg.extra_cpu * peer_cpu_all))
    more_cpu = np.sum(more, axis=0).tolist()
    less_cpu = np.sum(valid & ~more, axis=0).tolist()
    measured_cpu: list[bool] = np.asarray(valid.any(axis=0)).tolist()
    out = []
    for i in range(n):
        pos, lateness = positive[i], medians[i]
        p = sign_test_p(pos, negative[i])
        cpu_p = sign_test_p(more_cpu[i], less_cpu[i])
        if min(p, cpu_p) > cfg.max_p or lateness <= tau:
            continue
        cpu_i = extra_cpu[:, i]
        measured = measured_cpu[i]
        cpu = float(np.nanmedian(cpu_i)) if measured else math.nan
        peer_cpu = float(np.nanmedian(peer_cpu_all[:, i])) if measured else math.nan
        data = float(np.nanmedian(extra_data[:, i]))
        runq_i = extra_runq[:, i]
        runq = float(np.nanmedian(runq_i)) if not np.isnan(runq_i).all() else math.nan
        if data >= cfg.explain * lateness:
            cause: ArrivalCause = "data"
        elif measured and cpu > max(cfg.min_seconds, cfg.extra_cpu * peer_cpu) and cpu_p <= cfg.max_p:
            # More work on most steps, by the sign test, not only on the median one.
            cause = "compute"
        elif loader_bound[i]:
            # Waiting on its loader on most steps and no more work than its peers: the
            # loader is what is measured (its peers' waits can make the lateness larger
            # than the loader wait on a busy host; a host stall means neither was seen).
            cause = "data"
        elif runq >= cfg.explain_runq * lateness:  # NaN (not measured) compares False
            cause = "cpu_contention"
        else:
            cause = "host_stall"
        out.append(
            LateRank(
                rank=a.ranks[i],
                host=a.hosts[i],
                cause=cause,
                lateness_s=lateness,
                share=lateness / step_ref if step_ref > 0 else math.inf,
                late_steps=pos,
                steps=n_steps,
                p_value=p,
                evidence={
                    "lateness_s": lateness,
                    "extra_cpu_s": cpu,
                    "peer_cpu_s": peer_cpu,
                    "extra_data_wait_s": data,
                    "peer_wait_s": float(np.median(peer_wait[:, i])),
                    "transfer_s": float(np.median(a.transfer[:, i])),
                    "step_time_s": step_ref,
                    "cpu_p_value": cpu_p,
                    "extra_runq_s": runq,
                },
            )
        )
    return out


#: Tie-break of a host finding's cause (see :func:`slow_hosts`).
_HOST_CAUSE_ORDER: tuple[ArrivalCause, ...] = ("compute", "data", "host_stall", "cpu_contention", "host")


def slow_hosts(a: Aligned, late: Sequence[LateRank], cfg: Config = Config()) -> list[HostFinding]:
    """Hosts whose local ranks are late together (enough of them to be the host's fault)."""
    by_host: dict[str, list[int]] = {}
    for r, h in zip(a.ranks, a.hosts, strict=True):
        by_host.setdefault(h, []).append(r)
    if len(by_host) < 2:
        return []
    out = []
    for host, ranks in sorted(by_host.items()):
        hits = [x for x in late if x.host == host]
        need = max(cfg.host_min_ranks, math.ceil(cfg.host_fraction * len(ranks) - 1e-9))
        if len(hits) >= need:
            # The most common cause; a tie goes to the first in ``_HOST_CAUSE_ORDER``
            # (deterministic, and a host is named for contention only when most of its late
            # ranks waited for a core).
            causes = [x.cause for x in hits]
            cause = min(set(causes), key=lambda c: (-causes.count(c), _HOST_CAUSE_ORDER.index(c)))
            out.append(
                HostFinding(host, tuple(sorted(x.rank for x in hits)), cause, max(x.lateness_s for x in hits))
            )
    return out


def wait_transfer(a: Aligned) -> dict[int, tuple[float, float]]:
    """Per rank, the window's mean wait and transfer per step (for storage and views)."""
    if not a.steps:
        return {}
    w = a.wait.mean(axis=0)
    t = a.transfer.mean(axis=0)
    return {r: (float(w[i]), float(t[i])) for i, r in enumerate(a.ranks)}


def concat(batches: Sequence[RankSteps]) -> RankSteps:
    """One rank's batches joined into one series (steps must follow each other)."""
    ordered = sorted(batches, key=lambda b: b.first_step)
    first = ordered[0]
    out: dict[str, list[float | None]] = {k: [] for k in ("step_time_s", "data_wait_s", "sync_s", "cpu_s")}
    runq: list[float | None] = []
    expect = first.first_step
    for b in ordered:
        if b.first_step != expect:
            raise ValueError(f"rank {b.rank}: batch starts at step {b.first_step}, expected {expect}")
        for k, v in out.items():
            v.extend(getattr(b, k))
        n = len(b.sync_s)
        runq.extend([*b.runq_s[:n], *[None] * (n - len(b.runq_s))])
        expect += n
    return RankSteps(
        first.rank,
        first.host,
        first.first_step,
        [float(x or 0.0) for x in out["step_time_s"]],
        [float(x or 0.0) for x in out["data_wait_s"]],
        out["sync_s"],
        out["cpu_s"],
        runq if any(v is not None for v in runq) else (),
    )


def window(series: RankSteps, first: int, last: int) -> RankSteps:
    """Steps ``first..last`` (inclusive) of one rank's series: a stored window's share."""
    lo = max(0, first - series.first_step)
    hi = max(lo, last - series.first_step + 1)
    return RankSteps(
        series.rank,
        series.host,
        series.first_step + lo,
        series.step_time_s[lo:hi],
        series.data_wait_s[lo:hi],
        series.sync_s[lo:hi],
        series.cpu_s[lo:hi],
        series.runq_s[lo:hi],
    )


def persistent(history: Sequence[set[tuple[int, str]]], need: int = 2) -> set[tuple[int, str]]:
    """(rank, cause) pairs late in each of the last ``need`` windows: the flag to open.
    One late window (a rank's GC pause, a scheduler hiccup) opens nothing."""
    if len(history) < need:
        return set()
    out = set(history[-1])
    for h in history[-need:-1]:
        out &= h
    return out
