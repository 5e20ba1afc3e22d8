"""One run's analysis, window by window: both detectors and the progress tally behind one
JSON state.

The collector's analysis worker (and the evaluation harness, which feeds the same windows
without a database) hands this class one complete window at a time: the rank windows of
that index and the job's step rows of the same steps. It returns the flags that opened or
closed, each with the window index at which it happened, so that "windows to flag" can
be measured, and keeps its state as plain JSON so that any collector replica can continue.

The progress tally (:class:`ProgressTally`) keeps the running totals that the run
overview projects the finish from (productive step time, the wall-clock span, the
throughput of recent windows), so that reading progress costs one row, not a scan of a
month of steps.

Job samples (:func:`window_sample`) aggregate the per-step job rows of one window: tagged
steps (warm-up, checkpoint, evaluation) are left out of the means, and a window whose
steps are mostly tagged becomes a tagged sample, which the regression detector skips.
The sample's breakdown components add up to the step time, so that a regression can be
attributed to the component that moved: with the always-on timing, those of each step's
critical path (the last arriver's data wait, rest of the step and transfer,
:func:`timing_means`); else the means over ranks of the rank windows' profile fields
(when the profiler covered the window) and of data-loader wait.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field, replace
from typing import Any, cast

from .arrivals import RankSteps, line_up
from .efficiency import StageImbalance, stage_imbalance
from .late_arrivals import ArrivalDetector
from .links import LinkSample
from .peers import StragglerConfig
from .progress import ThroughputWindow
from .regressions import Baseline, RegressionConfig, RegressionDetector
from .robust import MAD_TO_SIGMA, mad, median
from .stragglers import StragglerDetector
from .types import Finding, JobStep, RankWindow, StepTag

STATE_VERSION = 1


@dataclass(frozen=True, slots=True)
class StepRow:
    """One job step as stored: mean step time over ranks, global tokens, its tag, and the
    wall-clock time it ended (Unix seconds, 0 when unknown)."""

    step: int
    step_time_s: float
    tokens: float
    tag: StepTag | None = None
    wall_end: float = 0.0


#: Planned pauses: their time is not productive (warm-up steps still train).
PAUSE_TAGS = frozenset({"checkpoint", "eval"})


@dataclass(slots=True)
class ProgressTally:
    """Running totals of the analysed steps, for progress and goodput.

    ``productive_s`` sums the step time of every step but checkpoint and evaluation
    steps; the wall span runs from the start of the first step to the end of the last,
    so restarts, queueing and planned pauses lower the calendar efficiency
    (``productive_s / wall_s``). ``recent`` holds ``[tokens, steps, seconds]`` of the
    untagged steps of the last ``keep`` windows: the current throughput and its spread.
    """

    productive_s: float = 0.0
    steps: int = 0
    wall_start: float | None = None
    wall_end: float | None = None
    recent: list[list[float]] = field(default_factory=list)
    keep: int = 20

    def add(self, steps: Sequence[StepRow]) -> None:
        for s in steps:
            self.steps += 1
            if s.tag not in PAUSE_TAGS:
                self.productive_s += s.step_time_s
            if s.wall_end > 0:
                start = s.wall_end - s.step_time_s
                self.wall_start = start if self.wall_start is None else min(self.wall_start, start)
                self.wall_end = s.wall_end if self.wall_end is None else max(self.wall_end, s.wall_end)
        untagged = [s for s in steps if s.tag is None]
        if untagged:
            self.recent.append(
                [sum(s.tokens for s in untagged), float(len(untagged)), sum(s.step_time_s for s in untagged)]
            )
            del self.recent[: -self.keep]

    @property
    def wall_s(self) -> float | None:
        if self.wall_start is None or self.wall_end is None:
            return None
        return self.wall_end - self.wall_start

    def throughput_windows(self) -> list[ThroughputWindow]:
        return [ThroughputWindow(tokens=t, steps=int(n), seconds=sec) for t, n, sec in self.recent]

    def to_dict(self) -> dict[str, Any]:
        return {
            "productive_s": self.productive_s,
            "steps": self.steps,
            "wall_start": self.wall_start,
            "wall_end": self.wall_end,
            "recent": [list(r) for r in self.recent],
            "keep": self.keep,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ProgressTally:
        return cls(
            productive_s=float(data.get("productive_s", 0.0)),
            steps=int(data.get("steps", 0)),
            wall_start=data.get("wall_start"),
            wall_end=data.get("wall_end"),
            recent=[[float(x) for x in r] for r in data.get("recent", [])],
            keep=int(data.get("keep", 20)),
        )


@dataclass(frozen=True, slots=True)
class Change:
    """A flag that opened or closed, and the window whose analysis opened or closed it."""

    finding: Finding
    window: int


def breakdown_means(ranks: Sequence[RankWindow]) -> dict[str, float]:
    """Means over ranks of the breakdown components present in every rank window given."""
    out: dict[str, float] = {}
    if not ranks:
        return out
    out["data_wait_s"] = sum(w.data_wait_s for w in ranks) / len(ranks)
    for comp in ("compute_s", "comm_exposed_s", "comm_overlapped_s", "idle_s"):
        values = [v for w in ranks if (v := getattr(w, comp)) is not None]
        if len(values) == len(ranks):
            out[comp] = sum(values) / len(values)
    return out


def window_sample(
    steps: Sequence[StepRow],
    *,
    first_step: int,
    last_step: int,
    mfu_per_token_rate: float | None,
    components: Mapping[str, float] | None = None,
) -> JobStep | None:
    """The job sample of one window (steps ``first_step..last_step``), or ``None`` if empty.

    ``mfu_per_token_rate`` converts tokens/s into MFU (``flops_per_token / (devices x
    peak)``); ``None`` when the peak is unknown, and then the sample has no MFU.
    """
    steps = [s for s in steps if s.step_time_s > 0]
    if not steps:
        return None
    span = last_step - first_step + 1
    untagged = [s for s in steps if s.tag is None]
    comps = dict(components or {})
    if 2 * len(untagged) < len(steps):
        tag = Counter(s.tag for s in steps if s.tag is not None).most_common(1)[0][0]
        seconds = sum(s.step_time_s for s in steps)
        return JobStep(step=last_step, step_time_s=seconds / len(steps), tokens=0.0, tag=tag, n_steps=span)
    seconds = sum(s.step_time_s for s in untagged)
    tokens = sum(s.tokens for s in untagged)
    mfu = tokens / seconds * mfu_per_token_rate if mfu_per_token_rate and seconds > 0 else None
    times = [s.step_time_s for s in untagged]
    mid = median(times)
    rate = mfu_per_token_rate if mfu is not None else None
    per_step_mfu = [s.tokens / s.step_time_s * rate for s in untagged] if rate else []
    return JobStep(
        step=last_step,
        step_time_s=seconds / len(untagged),
        tokens=tokens,
        mfu=mfu,
        tag=None,
        n_steps=span,
        compute_s=comps.get("compute_s"),
        comm_exposed_s=comps.get("comm_exposed_s"),
        comm_overlapped_s=comps.get("comm_overlapped_s"),
        data_wait_s=comps.get("data_wait_s"),
        idle_s=comps.get("idle_s"),
        cpu_s=comps.get("cpu_s"),
        step_time_median_s=mid,
        step_time_spread_s=MAD_TO_SIGMA * mad(times, mid),
        mfu_median=median(per_step_mfu) if per_step_mfu else None,
        n_samples=len(times),
    )


#: A step over this many times its window's median step time stays out of the breakdown.
LONG_STEP_RATIO = 3.0


def timing_means(timing: Sequence[Sequence[RankSteps]], excluded: Set[int] = frozenset()) -> dict[str, float]:
    """A window's breakdown from the always-on timing, along each step's critical path.

    A synchronous step lasts as long as its last arriver takes to reach the step's last
    collective, plus that collective's transfer; every other rank's exposed sync is mostly
    waiting for it. So per step and peer group the sample is the last arriver's (the rank
    with the smallest sync, :func:`.arrivals.line_up`): its data wait, its sync (the
    transfer), the rest of its step (``compute_s``: forward, backward and the host time
    between collectives) and its training thread's CPU time (``cpu_s``), averaged over the
    window's steps (those in ``excluded``, the tagged ones, left out) and the groups. A mean
    over all ranks would count the waits as communication: a job-wide slowdown of compute on
    ranks that share cores (or that drift apart) then read as exposed communication.
    A rank alone in its group is its own critical path; a step for which some rank of the
    group has no sync is left out (its last arriver is unknown), as :func:`.arrivals.line_up`
    does; so is a step over ``LONG_STEP_RATIO`` times the window's median (a stall owns a
    mean). :mod:`.attribution` splits the rest into compute and idle by the CPU time. Empty
    without timing."""
    samples: list[tuple[float, float, float, float | None]] = []  # step, data, sync, cpu

    def add(t: float, data: float, sync: float, cpu: float | None) -> None:
        samples.append((t, data, sync, cpu if cpu is not None and math.isfinite(cpu) else None))

    for group in timing:
        if len(group) > 1:
            lined = line_up(group)
            last = lined.wait.argmin(axis=1)
            for k, step in enumerate(lined.steps):
                j = int(last[k])
                t = float(lined.step_time[k, j])
                if step in excluded or not t > 0:
                    continue
                data = float(lined.data_wait[k, j])
                data = data if math.isfinite(data) else 0.0
                add(t, data, float(lined.transfer[k, j]), float(lined.cpu[k, j]))
            continue
        for r in group:
            for j, t in enumerate(r.step_time_s):
                sync = r.sync_s[j] if j < len(r.sync_s) else None
                if sync is None or not math.isfinite(sync) or not t > 0 or r.first_step + j in excluded:
                    continue
                wait = r.data_wait_s[j] if j < len(r.data_wait_s) else None
                add(
                    t,
                    wait if wait is not None and math.isfinite(wait) else 0.0,
                    sync,
                    r.cpu_s[j] if j < len(r.cpu_s) else None,
                )
    # A step far longer than the window's median (a rank descheduled or stopped for
    # seconds) would own the means: one 50 s step moves a 16-step window's compute by 3 s,
    # and the baseline's for a whole run. The regression detector reads medians for the
    # same reason; the breakdown leaves such steps out.
    cap = LONG_STEP_RATIO * median([t for t, *_ in samples]) if samples else 0.0
    kept = [x for x in samples if x[0] <= cap]
    if not kept:
        return {}
    n = len(kept)
    out = {
        "data_wait_s": sum(d for _, d, _, _ in kept) / n,
        "comm_exposed_s": sum(y for _, _, y, _ in kept) / n,
        "compute_s": sum(max(0.0, t - d - y) for t, d, y, _ in kept) / n,
    }
    cpus = [c for *_, c in kept if c is not None]
    if len(cpus) == n:
        out["cpu_s"] = sum(cpus) / n
    return out


class RunAnalysis:
    """Straggler and regression detection of one run, fed one complete window at a time."""

    def __init__(
        self,
        run: str,
        *,
        stragglers: StragglerConfig | None = None,
        regressions: RegressionConfig | None = None,
        baseline: Baseline | None = None,
        fingerprint: str | None = None,
    ) -> None:
        self.run = run
        self.stragglers = StragglerDetector(run, stragglers)
        self.arrivals = ArrivalDetector(run)
        self.regressions = RegressionDetector(run, regressions, baseline=baseline, fingerprint=fingerprint)
        self.imbalance: StageImbalance | None = None
        self.progress = ProgressTally()

    def feed(
        self,
        window: int,
        ranks: Sequence[RankWindow],
        steps: Sequence[StepRow],
        *,
        first_step: int,
        last_step: int,
        mfu_per_token_rate: float | None,
        timing: Sequence[Sequence[RankSteps]] = (),
        links: Sequence[LinkSample] = (),
    ) -> list[Change]:
        """Analyse one complete window (steps ``first_step..last_step``); return the flags
        that opened or closed in it. ``timing``: the window's per-step collective timing,
        one list of ranks per peer group (empty without the agent's communication hook);
        ``links``: its per-connection link samples."""
        changes: list[Change] = []
        if ranks:
            changes += [Change(replace(f, source="window"), window) for f in self.stragglers.update(ranks)]
            self.imbalance = stage_imbalance(ranks) or self.imbalance
        if timing:
            found = self.arrivals.update(window, timing, links)
            changes += [Change(replace(f, source="arrivals"), window) for f in found]
        # The always-on timing covers every window, the profiler only some: when a run has
        # the former, every window's breakdown comes from it, so that they compare.
        tagged = {s.step for s in steps if s.tag is not None}
        components = timing_means(timing, tagged) or breakdown_means(ranks)
        sample = window_sample(
            steps,
            first_step=first_step,
            last_step=last_step,
            mfu_per_token_rate=mfu_per_token_rate,
            components=components,
        )
        if sample is not None:
            changes += [Change(f, window) for f in self.regressions.update(sample)]
        self.progress.add(steps)
        return changes

    def open_findings(self) -> list[Finding]:
        """Every flag open now, with its latest numbers."""
        return (
            [replace(f, source="window") for f in self.stragglers.open_findings()]
            + [replace(f, source="arrivals") for f in self.arrivals.open_findings()]
            + self.regressions.open_findings()
        )

    def to_state(self) -> dict[str, Any]:
        """JSON-ready state; :meth:`from_state` rebuilds an equivalent analysis."""
        imb = self.imbalance
        return {
            "version": STATE_VERSION,
            "stragglers": self.stragglers.to_state(),
            "arrivals": self.arrivals.to_state(),
            "regressions": self.regressions.to_state(),
            "progress": self.progress.to_dict(),
            "imbalance": None
            if imb is None
            else {
                "stage_compute_s": {str(k): v for k, v in imb.stage_compute_s.items()},
                "slowest_stage": imb.slowest_stage,
                "ratio": imb.ratio,
                "cost_seconds": imb.cost_seconds,
                "cost_ratio": imb.cost_ratio,
                "message": imb.message,
            },
        }

    @classmethod
    def from_state(cls, run: str, state: Mapping[str, Any]) -> RunAnalysis:
        """Inverse of :meth:`to_state`."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported analysis state version {state.get('version')!r}")
        out = cls(run)
        out.stragglers = StragglerDetector.from_state(state["stragglers"])
        if "arrivals" in state:  # absent in a state saved before the detector existed
            out.arrivals = ArrivalDetector.from_state(state["arrivals"])
        out.regressions = RegressionDetector.from_state(state["regressions"])
        out.progress = ProgressTally.from_dict(state.get("progress", {}))
        raw = state.get("imbalance")
        if raw is not None:
            out.imbalance = StageImbalance(
                stage_compute_s={int(k): float(v) for k, v in dict(raw["stage_compute_s"]).items()},
                slowest_stage=int(raw["slowest_stage"]),
                ratio=float(raw["ratio"]),
                cost_seconds=float(raw["cost_seconds"]),
                cost_ratio=float(raw["cost_ratio"]),
                message=str(raw["message"]),
            )
        return out


def tag_of(code: int, names: Sequence[str]) -> StepTag | None:
    """A stored tag code (0 = none) as its name."""
    name = names[code] if 0 < code < len(names) else ""
    return cast("StepTag | None", name or None)
