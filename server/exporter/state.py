"""What ``/metrics`` shows, computed from plain rows by pure functions.

The reader (``read.py``) turns a few bounded SQL queries into the row types below; these
functions turn the rows into a :class:`RunSnapshot`, and ``families.py`` turns snapshots
into Prometheus families. Nothing here touches a database or a registry, so every number
can be checked on hand-made rows. Across ranks, the database ranks the values and
returns only the order statistics the quantiles interpolate between
(:func:`order_positions`, :func:`interpolate`) and the largest values (the top-K
candidates :func:`slowest` picks from), so a scrape does not grow with the ranks.

The row types (``JobStepSums``, ``RankWindowSums``, ``RunBaseline``) are named for the
stored sums they carry, apart from the analysis' own ``StepRow``, ``RankRow`` and ``Baseline``.

Definitions match the REST overview (``reads/queries.py``): a step's time is the mean over the
ranks that reported it, its global tokens are the reporting data-parallel replicas'
tokens scaled to all replicas, and MFU is tokens/s x FLOPs per token / (devices x peak).
"Current" values use the newest untagged steps, so a checkpoint or evaluation step never
shows up as a slow step, and warm-up produces no current value at all.

Why more than 400 lines: small pure functions, one per exported quantity, that the
unit tests check on hand-made rows; they share the row types above.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, get_args

from stepwatch import wire
from stepwatch.flops import per_token_rate

from ..analysis.robust import median
from ..analysis.types import Cause
from ..reads.status import DEFAULT_RULE, RunStatus, StatusRule
from ..storage.columns import window_of

#: The step tags (stored code = index + 1), as the ``tag`` label of the tagged-steps series.
TAGS = wire.TAGS[1:]

#: Quantiles across ranks exported for each per-rank quantity (0 and 1 are min and max).
QUANTILES: tuple[float, ...] = (0.0, 0.1, 0.5, 0.9, 0.99, 1.0)
#: The parts of a step (DESIGN §3); they sum to the step time.
PHASES: tuple[str, ...] = tuple(p.removesuffix("_s") for p in wire.STEP_PARTS)
EVENT_KINDS: tuple[str, ...] = ("straggler", "regression", "hang")
#: The analysis' causes (one contract), and ``unknown`` for an event without one.
STRAGGLER_CAUSES: tuple[str, ...] = (*get_args(Cause), "unknown")
#: (kind, cause) pairs of the open-events family: causes only for stragglers.
EVENT_SLOTS: tuple[tuple[str, str], ...] = (
    *(("straggler", c) for c in STRAGGLER_CAUSES),
    ("regression", ""),
    ("hang", ""),
)
#: Per-rank quantities: exported per selected rank and as quantiles across all ranks.
RANK_QUANTITIES: tuple[str, ...] = ("step_time", "data_wait", "compute", "comm_wait")
#: Newest untagged steps averaged into the "current" step time, tokens/s and MFU.
LATEST_STEPS = 10
#: A checkpoint or evaluation step this much longer than usual is still not a hang.
TAGGED_STEP_SLACK = 1.5


@dataclass(frozen=True, slots=True)
class JobStepSums:
    """One ``job_steps`` row (additive over the ranks that reported the step)."""

    step: int
    ranks: int
    token_ranks: int
    step_time_sum: float
    data_wait_max: float
    tokens: int
    padded_tokens: int | None
    tag: int

    @property
    def step_time_s(self) -> float:
        return self.step_time_sum / self.ranks if self.ranks else 0.0

    @property
    def usable(self) -> bool:
        return self.token_ranks > 0 and self.step_time_sum > 0

    def tokens_est(self, dp_size: int) -> float:
        return self.tokens * dp_size / self.token_ranks if self.token_ranks else 0.0


@dataclass(frozen=True, slots=True)
class RankWindowSums:
    """One ``rank_windows`` row: means per step of one rank over one window."""

    rank: int
    window: int
    n_steps: int
    step_time_sum: float
    data_wait_sum: float
    profiled_steps: int | None = None
    compute_s: float | None = None
    comm_overlapped_s: float | None = None
    comm_exposed_s: float | None = None
    idle_s: float | None = None
    comm_wait_s: float | None = None

    @property
    def step_time_s(self) -> float:
        return self.step_time_sum / self.n_steps if self.n_steps else 0.0

    @property
    def data_wait_s(self) -> float:
        return self.data_wait_sum / self.n_steps if self.n_steps else 0.0

    @property
    def profiled(self) -> bool:
        return self.profiled_steps is not None and self.compute_s is not None


@dataclass(frozen=True, slots=True)
class EventRow:
    """An open ``events`` row, as far as the metrics need it."""

    kind: str
    cause: str | None
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]
    first_step: int
    cost_seconds: float
    cost_ratio: float


@dataclass(frozen=True, slots=True)
class Rates:
    step_time_s: float
    tokens_per_s: float
    data_wait_s: float
    padding_ratio: float | None


@dataclass(frozen=True, slots=True)
class RunBaseline:
    """The run's own reference: its first untagged steps after warm-up."""

    step_time_s: float
    tokens_per_s: float
    steps: int
    last_step: int


@dataclass(frozen=True, slots=True)
class Distribution:
    """A quantity across the ranks of one window: exact quantiles, count and sum."""

    quantiles: tuple[tuple[float, float], ...]
    count: int
    total: float


@dataclass(frozen=True, slots=True)
class RankSeries:
    """Identity (dcgm-exporter's ``Hostname`` and ``gpu``) and values of a selected rank."""

    rank: int
    host: str
    gpu: str
    values: Mapping[str, float]


@dataclass(frozen=True, slots=True)
class FlaggedRank:
    rank: int
    host: str
    gpu: str
    cause: str
    cost_seconds: float
    cost_ratio: float
    first_step: int


@dataclass(frozen=True, slots=True)
class Convention:
    """The run's FLOPs convention as labels, and the MFU/HFU scales (None: no peak)."""

    id: str
    formula: str
    dtype: str
    device: str
    peak_source: str
    mfu_scale: float | None
    hfu_scale: float | None


@dataclass(frozen=True)
class RunSnapshot:
    name: str
    world_size: int
    convention: Convention
    last_report_ts: float
    ranks_reporting: int = 0
    last_step: int | None = None
    last_step_ts: float | None = None
    tokens_total: float | None = None
    status: RunStatus = "live"
    rates: Rates | None = None
    baseline: RunBaseline | None = None
    hang_threshold_s: float | None = None
    tagged: Mapping[str, int] = field(default_factory=dict)
    breakdown: Mapping[str, float] | None = None
    overlap_ratio: float | None = None
    distributions: Mapping[str, Distribution] = field(default_factory=dict)
    ranks: Sequence[RankSeries] = ()
    flagged: Sequence[FlaggedRank] = ()
    events_open: Mapping[tuple[str, str], int] = field(default_factory=dict)
    events_total: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Snapshot:
    runs: Sequence[RunSnapshot]
    runs_active: int
    ok: bool
    read_seconds: float = 0.0


# -- run level -----------------------------------------------------------------------


def convention_of(conv: Mapping[str, Any] | None, world_size: int) -> Convention:
    """Labels and scales from the stored convention (``stepwatch.flops.per_token_rate``)."""
    conv = conv or {}

    return Convention(
        id=str(conv.get("id") or ""),
        formula=str(conv.get("formula") or ""),
        dtype=str(conv.get("dtype") or ""),
        device=str(conv.get("device_name") or ""),
        peak_source=str(conv.get("peak_source") or ""),
        mfu_scale=per_token_rate(conv, world_size),
        hfu_scale=per_token_rate(conv, world_size, "hfu_flops_per_token"),
    )


def current_rates(rows: Iterable[JobStepSums], dp_size: int, latest: int = LATEST_STEPS) -> Rates | None:
    """Step time, tokens/s, data wait and padding over the newest ``latest`` untagged steps."""
    picked = sorted((r for r in rows if r.tag == 0 and r.usable), key=lambda r: r.step, reverse=True)[:latest]
    if not picked:
        return None
    seconds = sum(r.step_time_s for r in picked)
    padded = [r for r in picked if r.padded_tokens]
    return Rates(
        step_time_s=seconds / len(picked),
        tokens_per_s=sum(r.tokens_est(dp_size) for r in picked) / seconds,
        data_wait_s=sum(r.data_wait_max for r in picked) / len(picked),
        padding_ratio=(
            min(
                1.0, max(0.0, 1.0 - sum(r.tokens for r in padded) / sum(r.padded_tokens or 0 for r in padded))
            )
            if padded
            else None
        ),
    )


def baseline_of(rows: Iterable[JobStepSums], dp_size: int) -> RunBaseline | None:
    """Median step time and mean tokens/s of the given (first, untagged) steps."""
    picked = [r for r in rows if r.tag == 0 and r.usable]
    if not picked:
        return None
    seconds = sum(r.step_time_s for r in picked)
    return RunBaseline(
        step_time_s=median([r.step_time_s for r in picked]),
        tokens_per_s=sum(r.tokens_est(dp_size) for r in picked) / seconds,
        steps=len(picked),
        last_step=max(r.step for r in picked),
    )


def tagged_counts(rows: Iterable[JobStepSums]) -> dict[str, int]:
    """How many of the given steps carry each tag (every tag present, zeros included)."""
    counts = dict.fromkeys(TAGS, 0)
    for r in rows:
        if 1 <= r.tag <= len(TAGS):
            counts[TAGS[r.tag - 1]] += 1
    return counts


def longest_tagged_step(rows: Iterable[JobStepSums]) -> float:
    """Longest checkpoint or evaluation step among the rows (0 when none)."""
    return max((r.step_time_s for r in rows if r.tag in (2, 3)), default=0.0)


def hang_threshold(
    rows: Iterable[JobStepSums], longest_tagged_s: float, rule: StatusRule = DEFAULT_RULE
) -> float:
    """The analysis' hang threshold (``max(k x median step, floor)``, the startup allowance
    before any step past warm-up), widened so that a checkpoint or evaluation as long as the
    longest one seen is not taken for a hang."""
    times = [r.step_time_s for r in rows if r.tag == 0 and r.usable]
    base = rule.threshold_s(median(times) if times else None)
    return max(base, TAGGED_STEP_SLACK * longest_tagged_s)


def settled_through(last_step: int, window_steps: int, *, done: bool = False) -> int:
    """Steps up to here have been reported by every rank that will report them, so their
    token estimate no longer changes: two windows behind the newest step while the run
    steps, the newest step itself once it is done (finished, or stalled: no step for
    longer than the hang threshold), or a short or finished run would never count its
    last two windows."""
    return last_step if done else last_step - max(2 * window_steps, 16)


# -- across ranks --------------------------------------------------------------------


def order_positions(n: int, qs: Sequence[float] = QUANTILES) -> set[int]:
    """The 0-based positions, in ascending order of ``n`` values, that the quantiles
    ``qs`` interpolate between."""
    out: set[int] = set()
    for q in qs:
        lo = math.floor(q * (n - 1))
        out.update((lo, min(lo + 1, n - 1)))
    return out if n > 0 else set()


def interpolate(
    n: int, at: Mapping[int, float], qs: Sequence[float] = QUANTILES
) -> tuple[tuple[float, float], ...]:
    """Exact quantiles by linear interpolation between order statistics, from the values
    ``at`` the :func:`order_positions` of ``n`` values."""
    if n == 0:
        return ()
    out = []
    for q in qs:
        pos = q * (n - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, n - 1)
        out.append((q, at[lo] + (at[hi] - at[lo]) * (pos - lo)))
    return tuple(out)


def quantiles(values: Sequence[float], qs: Sequence[float] = QUANTILES) -> tuple[tuple[float, float], ...]:
    """Exact quantiles of ``values`` (what the database's ordering gives :func:`interpolate`)."""
    ordered = sorted(values)
    return interpolate(len(ordered), dict(enumerate(ordered)), qs)


def distribution(n: int, at: Mapping[int, float], total: float) -> Distribution | None:
    if n == 0:
        return None
    return Distribution(quantiles=interpolate(n, at), count=n, total=total)


def windows_in_view(last_step: int | None, window_steps: int) -> tuple[int, int]:
    """The newest window (likely still filling) and the one before it (likely complete)."""
    if last_step is None or last_step <= 0:
        return (0, 0)
    newest = window_of(last_step, max(1, window_steps))
    return (max(0, newest - 1), newest)


def reporting_since(last_step: int | None, window_steps: int) -> int:
    """First step of the window before the newest (window 0 also holds step 0): the
    ranks whose newest step is at or after it reported one of the two newest windows."""
    prev = windows_in_view(last_step, window_steps)[0]
    return prev * window_steps + (1 if prev else 0)


def complete_window(ranks_per_window: Mapping[int, int], newest: int) -> int | None:
    """The newest window most ranks finished, given how many ranks stored each window:
    the window before the newest is complete for every live rank; the newest one is used
    only while it is the run's first (None: neither has a row)."""
    if ranks_per_window.get(newest - 1):
        return newest - 1
    return newest if ranks_per_window.get(newest) else None


def breakdown(means: Mapping[str, float] | None) -> tuple[dict[str, float] | None, float | None]:
    """The parts of the step (means over the profiled ranks) and the overlap ratio
    (overlapped communication / all communication)."""
    if not means:
        return None, None
    parts = {p: float(means[p]) for p in PHASES}
    comm = parts["comm_overlapped"] + parts["comm_exposed"]
    return parts, (parts["comm_overlapped"] / comm if comm > 0 else None)


def rank_values(
    complete: Mapping[int, RankWindowSums], profiled: Mapping[int, RankWindowSums]
) -> dict[int, dict[str, float]]:
    """Per rank: step time and data wait from the complete window, compute and
    collective wait from the newest profiled window (when there is one)."""
    out: dict[int, dict[str, float]] = {}
    for rank, r in complete.items():
        out.setdefault(rank, {}).update(step_time=r.step_time_s, data_wait=r.data_wait_s)
    for rank, r in profiled.items():
        if not r.profiled:
            continue
        values = out.setdefault(rank, {})
        values["compute"] = float(r.compute_s or 0.0)
        if r.comm_wait_s is not None:
            values["comm_wait"] = float(r.comm_wait_s)
    return out


def slowest(values: Mapping[int, Mapping[str, float]], k: int) -> list[int]:
    """The ``k`` slowest ranks: by compute time where the profiler measured it (in
    synchronous training every rank's step time is the same, so compute tells the
    culprit), otherwise by step time. Ties break towards the lower rank."""
    if k <= 0 or not values:
        return []
    key = "compute" if any("compute" in v for v in values.values()) else "step_time"
    ranked = sorted(((v[key], rank) for rank, v in values.items() if key in v), key=lambda t: (-t[0], t[1]))
    return [rank for _, rank in ranked[:k]]


def flagged_ranks(events: Iterable[EventRow], limit: int) -> list[tuple[int, str, EventRow]]:
    """Ranks named by open straggler events, costliest first, each once, at most ``limit``."""
    best: dict[int, tuple[str, EventRow]] = {}
    for ev in events:
        if ev.kind != "straggler":
            continue
        for i, rank in enumerate(ev.ranks):
            host = ev.hosts[i] if i < len(ev.hosts) else (ev.hosts[0] if ev.hosts else "")
            held = best.get(rank)
            if held is None or ev.cost_seconds > held[1].cost_seconds:
                best[rank] = (host, ev)
    ordered = sorted(best.items(), key=lambda item: (-item[1][1].cost_seconds, item[0]))
    return [(rank, host, ev) for rank, (host, ev) in ordered[: max(0, limit)]]


def cause_label(cause: str | None) -> str:
    """A straggler's cause as a label value from a fixed set."""
    return cause if cause in STRAGGLER_CAUSES else "unknown"


def open_event_counts(events: Iterable[EventRow]) -> dict[tuple[str, str], int]:
    """Open events by (kind, cause); every slot present, zeros included."""
    counts = dict.fromkeys(EVENT_SLOTS, 0)
    for ev in events:
        if ev.kind == "straggler":
            counts[("straggler", cause_label(ev.cause))] += 1
        elif (ev.kind, "") in counts:
            counts[(ev.kind, "")] += 1
    return counts
