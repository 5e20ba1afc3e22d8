"""Regressions of job MFU and step time: online one-sided CUSUM against a frozen baseline.

Method. The first ``baseline_samples`` eligible windows (after tagged warm-up and
``skip_samples`` more) give a frozen baseline per metric (:mod:`.baseline`): the median of
the windows' robust values (each window's median over its per-step samples) and the
baseline's own window-to-window noise as the scale, never below the standard error of one
window's median nor ``rel_scale_floor`` of the median. Every later window becomes a robust
z-score in the bad direction (MFU down, step time up), clipped to ``+-clip_z`` so that one
odd window adds at most ``clip_z - k`` to the sum, and feeds a one-sided CUSUM
``S = max(0, S + z - k)``. The reference value ``k`` is half the smallest change worth
reporting, in robust sigmas: ``max(k, min_change / 2 * median / scale)``, so a quiet
baseline does not make the detector chase 1% wander. A regression opens when ``S >= h``
and the excursion has lasted at least ``min_duration`` windows; its start is the window
after the last low of S (the classical CUSUM change-point estimate). It closes, with
hysteresis, once ``close_after`` consecutive windows are back within ``close_z`` robust
sigmas of the baseline. Windows tagged warm-up, checkpoint or evaluation are skipped
entirely (neither baseline nor sums, nor do they break an excursion); a few long steps in
an untagged window (a checkpoint nobody tagged) barely move its median.

Tuning (defaults ``k = 0.5``, ``h = 10``, ``clip_z = 6``, ``min_change = 0.03``,
``baseline_samples = 12`` growing to ``baseline_max = 120``, ``loc_margin = 1.5``). The
goal: a sustained job-wide change of 10% flagged within 5 windows of its onset, none on
clean runs. With the scale at its 1% floor a 10% change adds ``6 - 1.5 = 4.5`` per window
and opens at the third window (``min_duration``). Measured with ``tests/synthetic.py``'s
``job_series`` (20 seeds; jitter 3%, GC pauses, loader stalls, a slow AR(1) drift of
sigma 0.3%, tagged pauses): 0 opens over 20 clean series of 10,000 windows; +10% step time
through compute, exposed communication, data wait or idle and a 5% MFU drop all open in 3
windows (a 5% drop in 3-4). ``h = 8`` opened 2 false regressions over those 200,000
windows with a frozen 12-window baseline, which is why the baseline learns and ``h``
stayed 10. At five times the jitter (a window-to-window noise of 3.4%) a 10% change takes
5-6 windows and about 6 clean windows in 10,000 open one: below that signal-to-noise a
10% change cannot be told from noise in 5 windows. ``stepwatch evaluate`` runs the same
checks on the simulator (job-wide +10% scenarios, clean runs with untagged checkpoints).
Re-tune the same way: sweep (k or min_change, h) over clean runs (count opens) and runs
with an injected change (windows to open).

Attribution (:mod:`.attribution`) compares the means of the breakdown parts over the
regression period with the baseline's and names the one whose time grew most, e.g. "MFU
-9.0% from step 41,200 (42.0% -> 38.2%): exposed communication +1.10 s/step; data wait
unchanged". A named baseline run: :func:`build_baseline` freezes one from that run's
windows with its config fingerprint; a :class:`RegressionDetector` given it (and the same
fingerprint) detects at once; :mod:`.compare` compares whole runs.

State: :meth:`RegressionDetector.to_state` / :meth:`RegressionDetector.from_state` (JSON-ready
dicts holding the baseline, or the samples collected towards it, and the sums).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from . import _format as fmt
from .attribution import MEANS, attribute, deltas
from .baseline import (
    MEDIAN_SE,
    METRICS,
    Baseline,
    FingerprintMismatchError,
    MetricBaseline,
    freeze,
    is_eligible,
    metric_value,
)
from .robust import clip
from .types import Finding, JobStep, Status

STATE_VERSION = 1

__all__ = [
    "METRICS",
    "Baseline",
    "FingerprintMismatchError",
    "RegressionConfig",
    "RegressionDetector",
    "build_baseline",
]


@dataclass(frozen=True, slots=True)
class RegressionConfig:
    """CUSUM parameters (see the module docstring for how the defaults were chosen)."""

    k: float = 0.5
    h: float = 10.0
    clip_z: float = 6.0
    baseline_samples: int = 12
    baseline_max: int = 120
    loc_margin: float = 1.5
    skip_samples: int = 0
    min_duration: int = 3
    min_change: float = 0.03
    close_after: int = 5
    close_z: float = 1.0
    rel_scale_floor: float = 0.01
    unchanged_ratio: float = 0.01

    def __post_init__(self) -> None:
        if self.k < 0 or self.h <= 0 or self.clip_z <= self.k:
            raise ValueError("need k >= 0, h > 0 and clip_z > k")
        if self.baseline_samples < 3 or self.min_duration < 1 or self.close_after < 1:
            raise ValueError("need baseline_samples >= 3, min_duration >= 1, close_after >= 1")
        if self.baseline_max < self.baseline_samples or self.loc_margin < 0:
            raise ValueError("need baseline_max >= baseline_samples and loc_margin >= 0")
        if self.rel_scale_floor <= 0:
            raise ValueError("rel_scale_floor must be > 0")

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the parameters."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RegressionConfig:
        """Inverse of :meth:`to_dict`; unknown keys are ignored."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def build_baseline(
    samples: Iterable[JobStep],
    *,
    run: str,
    fingerprint: str | None = None,
    config: RegressionConfig | None = None,
) -> Baseline:
    """Freeze a baseline from a run's series as the detector would (tags, skip, first B)."""
    cfg = config or RegressionConfig()
    eligible = [s for s in samples if is_eligible(s)][cfg.skip_samples :][: cfg.baseline_samples]
    if len(eligible) < 3:
        raise ValueError("a baseline needs at least 3 eligible samples")
    return freeze(eligible, run, fingerprint, cfg.rel_scale_floor)


@dataclass(slots=True)
class _Cusum:
    """CUSUM sum of one metric and the running means of the current excursion."""

    s: float = 0.0
    low: float = 0.0
    peak: float = 0.0
    start_step: int = 0
    last_step: int = 0
    n: int = 0
    value_sum: float = 0.0
    step_time_sum: float = 0.0
    comp_sum: dict[str, float] = field(default_factory=dict)
    comp_n: dict[str, int] = field(default_factory=dict)
    is_open: bool = False
    recovered: int = 0

    def restart(self) -> None:
        """Forget the excursion so far: S reached a new low, the change starts after it."""
        self.low = self.s
        self.n = 0
        self.value_sum = self.step_time_sum = 0.0
        self.comp_sum = {}
        self.comp_n = {}

    def add(self, sample: JobStep, value: float) -> None:
        if self.n == 0:
            self.start_step = sample.first_step
        self.n += 1
        self.last_step = sample.step
        self.value_sum += value
        self.step_time_sum += sample.step_time_s
        self.peak = max(self.peak, self.s)
        for comp in MEANS:
            v = getattr(sample, comp)
            if v is not None:
                self.comp_sum[comp] = self.comp_sum.get(comp, 0.0) + v
                self.comp_n[comp] = self.comp_n.get(comp, 0) + 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> _Cusum:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


class RegressionDetector:
    """Online regression detection on one run's job series (see the module docstring)."""

    def __init__(
        self,
        run: str,
        config: RegressionConfig | None = None,
        *,
        baseline: Baseline | None = None,
        fingerprint: str | None = None,
    ) -> None:
        if baseline is not None and baseline.fingerprint != fingerprint:
            raise FingerprintMismatchError(
                f"run {run!r} (fingerprint {fingerprint!r}) is not comparable with baseline run "
                f"{baseline.run!r} (fingerprint {baseline.fingerprint!r})"
            )
        self.run = run
        self.config = config or RegressionConfig()
        self.fingerprint = fingerprint
        self._baseline = baseline
        self._pending: list[JobStep] = []
        self._skipped = 0
        #: The run's own baseline keeps learning (see :meth:`_learn`): the in-control
        #: windows it is formed from, and those of an excursion still undecided.
        self._learning = baseline is None
        self._learned: list[JobStep] = []
        self._held: list[JobStep] = []
        self._cusum: dict[str, _Cusum] = {m: _Cusum() for m in METRICS}

    @property
    def baseline(self) -> Baseline | None:
        """The frozen baseline, or ``None`` while it is still being collected."""
        return self._baseline

    def extend(self, samples: Iterable[JobStep]) -> list[Finding]:
        """Feed several samples in order; return the regressions opened or closed."""
        events: list[Finding] = []
        for sample in samples:
            events.extend(self.update(sample))
        return events

    def update(self, sample: JobStep) -> list[Finding]:
        """Feed one sample (a step or a window); return the regressions opened or closed."""
        cfg = self.config
        if not is_eligible(sample):
            return []
        if self._baseline is None:
            if self._skipped < cfg.skip_samples:
                self._skipped += 1
                return []
            self._pending.append(sample)
            if len(self._pending) >= cfg.baseline_samples:
                self._baseline = freeze(self._pending, self.run, self.fingerprint, cfg.rel_scale_floor)
                self._learned, self._pending = self._pending, []
            return []
        events: list[Finding] = []
        for metric, sign in METRICS.items():
            value = metric_value(sample, metric)
            base = self._baseline.metrics.get(metric)
            if value is None or base is None:
                continue
            z = clip(sign * (value - base.median) / base.scale, cfg.clip_z)
            st = self._cusum[metric]
            st.s = max(0.0, st.s + z - self._k(base))
            if st.is_open:
                st.add(sample, value)
                st.recovered = st.recovered + 1 if z <= cfg.close_z else 0
                if st.recovered >= cfg.close_after:
                    events.append(self._finding(metric, st, "closed"))
                    self._cusum[metric] = _Cusum()
                continue
            if st.s <= 0.0:
                self._cusum[metric] = _Cusum()
                continue
            if st.n and st.s <= st.low:
                st.restart()
                continue
            st.add(sample, value)
            if st.s >= cfg.h and st.n >= cfg.min_duration:
                st.is_open = True
                events.append(self._finding(metric, st, "open"))
        self._learn(sample)
        return events

    def _learn(self, sample: JobStep) -> None:
        """Grow the run's own baseline with windows that turned out to be in control.

        A baseline of a dozen windows places the level and the noise only roughly (the
        median of 12 is off by ~0.36 sigma, their MAD by a third either way), and a frozen
        error is paid on every later window. So until ``baseline_max`` windows, each window
        that no excursion is running through joins it, with the windows of an excursion
        that ended without opening a regression (leaving those out would cut the upper
        tail and shrink the scale); an excursion that opens one is never learned. A named
        baseline run's baseline is that run's and does not learn.
        """
        cfg = self.config
        if not self._learning or len(self._learned) >= cfg.baseline_max:
            return
        if any(st.is_open for st in self._cusum.values()):
            self._held = []
            return
        if any(st.s > 0.0 for st in self._cusum.values()):
            self._held.append(sample)
            return
        self._learned += [*self._held, sample]
        self._held = []
        del self._learned[cfg.baseline_max :]
        self._baseline = freeze(self._learned, self.run, self.fingerprint, cfg.rel_scale_floor)

    def open_findings(self) -> list[Finding]:
        """Regressions open now, with their latest numbers."""
        return [self._finding(m, st, "open") for m, st in self._cusum.items() if st.is_open]

    def to_state(self) -> dict[str, Any]:
        """JSON-ready state; :meth:`from_state` rebuilds an equivalent detector."""
        return {
            "version": STATE_VERSION,
            "run": self.run,
            "fingerprint": self.fingerprint,
            "config": self.config.to_dict(),
            "baseline": None if self._baseline is None else self._baseline.to_dict(),
            "pending": [asdict(s) for s in self._pending],
            "learning": self._learning,
            "learned": [asdict(s) for s in self._learned],
            "held": [asdict(s) for s in self._held],
            "skipped": self._skipped,
            "cusum": {m: st.to_dict() for m, st in self._cusum.items()},
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> RegressionDetector:
        """Inverse of :meth:`to_state`."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported regression state version {state.get('version')!r}")
        fp = state.get("fingerprint")
        det = cls(
            str(state["run"]),
            RegressionConfig.from_dict(state["config"]),
            fingerprint=None if fp is None else str(fp),
        )
        raw_base = state.get("baseline")
        det._baseline = None if raw_base is None else Baseline.from_dict(raw_base)
        det._pending = [JobStep(**s) for s in state.get("pending", [])]
        det._learning = bool(state.get("learning", False))
        det._learned = [JobStep(**s) for s in state.get("learned", [])]
        det._held = [JobStep(**s) for s in state.get("held", [])]
        det._skipped = int(state.get("skipped", 0))
        for metric, raw in dict(state.get("cusum", {})).items():
            if metric in det._cusum:
                det._cusum[metric] = _Cusum.from_dict(raw)
        return det

    def _k(self, base: MetricBaseline) -> float:
        """Reference value in robust sigmas: half the smallest change worth reporting, and
        never below ``k`` plus ``loc_margin`` standard errors of the baseline's own median
        (a level known from few windows is known only so well, and its error would push
        every later window the same way)."""
        cfg = self.config
        k = cfg.k + cfg.loc_margin * MEDIAN_SE / math.sqrt(max(base.n, 1))
        return min(max(k, 0.5 * cfg.min_change * abs(base.median) / base.scale), 0.9 * cfg.clip_z)

    def _finding(self, metric: str, st: _Cusum, status: Status) -> Finding:
        assert self._baseline is not None  # findings exist only after the baseline froze
        base = self._baseline
        ref = base.metrics[metric].median
        current = st.value_sum / st.n
        change = (current - ref) / ref if ref else 0.0
        step_now = st.step_time_sum / st.n
        cost_s = max(0.0, step_now - base.step_time_s)
        cost_ratio = max(0.0, METRICS[metric] * change)
        moved = deltas({c: st.comp_sum[c] / n for c, n in st.comp_n.items() if n}, base.components)
        evidence: dict[str, float] = {
            "baseline_median": ref,
            "baseline_scale": base.metrics[metric].scale,
            "current_mean": current,
            "change_ratio": change,
            "cusum": st.s,
            "cusum_peak": max(st.peak, st.s),
            "samples": float(st.n),
            "baseline_step_time_s": base.step_time_s,
            "current_step_time_s": step_now,
        }
        evidence.update({f"delta_{c}": d for c, d in moved.items()})
        if metric == "mfu":
            head = f"MFU {fmt.signed_pct(change)}"
            values = f"({fmt.pct(ref)} -> {fmt.pct(current)})"
        else:
            head = f"Step time {fmt.signed_pct(change)}"
            values = f"({fmt.secs(ref)} -> {fmt.secs(current)})"
        when = f"from step {fmt.step(st.start_step)}"
        if status == "closed":
            when += f" to {fmt.step(st.last_step)} (recovered)"
        attribution = attribute(moved, base.step_time_s * self.config.unchanged_ratio)
        return Finding(
            kind="regression",
            run=self.run,
            key=f"regression:{metric}",
            cause=None,
            ranks=(),
            hosts=(),
            first_step=st.start_step,
            last_step=st.last_step,
            status=status,
            evidence=evidence,
            cost_seconds=cost_s,
            cost_ratio=cost_ratio,
            message=f"{head} {when} {values}: {attribution}.",
            metric=metric,
        )
