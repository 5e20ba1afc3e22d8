"""Regressions of job MFU and step time: online one-sided CUSUM against a frozen baseline.

Method. The first ``baseline_samples`` eligible samples (after tagged warm-up and
``skip_samples`` more) give a frozen baseline per metric: median and floored robust scale
``max(1.4826 MAD, 1% of median)``. Every later sample becomes a robust z-score in the bad
direction (MFU down, step time up), clipped to ``+-clip_z`` so that one GC pause or one
untagged checkpoint adds at most ``clip_z - k`` to the sum, and feeds a one-sided CUSUM
``S = max(0, S + z - k)``. The reference value ``k`` is half the smallest change worth
reporting, in robust sigmas: ``max(k, min_change / 2 * median / scale)``, so a quiet
baseline does not make the detector chase 1% wander. A regression opens when ``S >= h``
and the excursion has lasted at least ``min_duration`` samples; its start is the sample
after the last low of S (the classical CUSUM change-point estimate). It closes, with
hysteresis, once ``close_after`` consecutive samples are back within ``close_z`` robust
sigmas of the baseline. Samples tagged warm-up, checkpoint or evaluation are skipped
entirely: they neither feed the baseline nor the sums nor break an excursion.

Tuning (defaults ``k = 0.5``, ``h = 10``, ``clip_z = 4``, ``min_change = 0.03``). With
the tests' ``job_series`` (``tests/synthetic.py``: window samples of 20 steps,
lognormal step jitter sigma 3%, GC pauses, loader stalls, a slow AR(1) drift of the job's
speed with stationary sigma 0.3%, tagged warm-up, checkpoint and eval samples) we counted
regressions opened on 20 clean series of 10,000 windows (200,000 windows) and the windows
to open on 20 series with an MFU drop of 5%, 3% and 2%:

============================  ==============  =========  =========  ==========
setting                       false opens     5% drop    3% drop    2% drop
============================  ==============  =========  =========  ==========
k 0.5, h 10, no min_change    732             1-4        -          -
k 1.0, h 10 (min_change 2%)   9               4          4-8        5-31
k 1.5, h 8 (min_change 3%)    0               4          4-9        6-196
k 1.5, h 10 (min_change 3%)   0               4-5        5-12       8-never
============================  ==============  =========  =========  ==========

(ranges are min-max over the seeds; "-" means many opens before the change). The
textbook k = 0.5 opens on the slow drift of the baseline level; k = 1.5 sigma, i.e. a
3% smallest change at the 1% scale floor, removes that while a 5% drop still opens in 4-5
windows, inside the goal of 10; h = 10 rather than 8 keeps margin for noisier runs.
``clip_z = 4`` caps one bad window at 2.5 with this k, so no single window opens a
regression. Re-tune with the simulator the same way: sweep (k or min_change, h) over clean
runs (count opens) and runs with an injected drop (windows to open).

Attribution compares the means of the breakdown components (compute, exposed
communication, data wait, idle; they sum to step time) over the regression period with
the baseline means and names the one whose time grew most, e.g. "MFU -9.0% from step
41,200 (42.0% -> 38.2%): exposed communication +1.10 s/step; data wait unchanged".

Against another run: :func:`build_baseline` freezes a baseline from a named run's samples
and records its config fingerprint; a :class:`RegressionDetector` given that baseline (and
the same fingerprint) starts detecting at once, and :func:`compare_runs` does that for a
finished series. Runs whose fingerprints differ are not comparable
(:class:`FingerprintMismatchError`).

State: :meth:`RegressionDetector.to_state` / :meth:`RegressionDetector.from_state` (JSON-ready
dicts holding the baseline, or the samples collected towards it, and the sums).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from . import _format as fmt
from .robust import MAD_TO_SIGMA, clip, mad, median
from .types import EXCLUDED_TAGS, Finding, JobStep, Status

STATE_VERSION = 1

#: Metric name -> +1 when an increase is bad, -1 when a decrease is bad.
METRICS: Mapping[str, float] = {"mfu": -1.0, "step_time": 1.0}

#: Breakdown components that add up to the step time, with the words a person reads.
COMPONENTS: Mapping[str, str] = {
    "compute_s": "compute",
    "comm_exposed_s": "exposed communication",
    "data_wait_s": "data wait",
    "idle_s": "idle",
}


class FingerprintMismatchError(ValueError):
    """Two runs with different config fingerprints are not comparable."""


@dataclass(frozen=True, slots=True)
class RegressionConfig:
    """CUSUM parameters (see the module docstring for how the defaults were chosen)."""

    k: float = 0.5
    h: float = 10.0
    clip_z: float = 4.0
    baseline_samples: int = 30
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


@dataclass(frozen=True, slots=True)
class MetricBaseline:
    """Frozen location and scale of one metric."""

    median: float
    scale: float
    n: int


@dataclass(frozen=True, slots=True)
class Baseline:
    """A run's frozen post-warm-up baseline: per-metric median/scale, component means."""

    run: str
    fingerprint: str | None
    first_step: int
    last_step: int
    step_time_s: float
    metrics: Mapping[str, MetricBaseline]
    components: Mapping[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "run": self.run,
            "fingerprint": self.fingerprint,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "step_time_s": self.step_time_s,
            "metrics": {k: asdict(v) for k, v in self.metrics.items()},
            "components": dict(self.components),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Baseline:
        """Inverse of :meth:`to_dict`."""
        fp = data.get("fingerprint")
        return cls(
            run=str(data["run"]),
            fingerprint=None if fp is None else str(fp),
            first_step=int(data["first_step"]),
            last_step=int(data["last_step"]),
            step_time_s=float(data["step_time_s"]),
            metrics={
                str(k): MetricBaseline(float(v["median"]), float(v["scale"]), int(v["n"]))
                for k, v in dict(data["metrics"]).items()
            },
            components={str(k): float(v) for k, v in dict(data.get("components", {})).items()},
        )


def metric_value(sample: JobStep, metric: str) -> float | None:
    """The value of ``metric`` in a sample, or ``None`` when it is unknown."""
    if metric == "mfu":
        return sample.mfu
    if metric == "step_time":
        return sample.step_time_s if sample.step_time_s > 0 else None
    raise ValueError(f"unknown metric {metric!r}")


def is_eligible(sample: JobStep) -> bool:
    """Warm-up, checkpoint and evaluation samples are never evidence of a regression."""
    return sample.tag not in EXCLUDED_TAGS


def _freeze(samples: Sequence[JobStep], run: str, fingerprint: str | None, cfg: RegressionConfig) -> Baseline:
    metrics: dict[str, MetricBaseline] = {}
    for metric in METRICS:
        values = [v for s in samples if (v := metric_value(s, metric)) is not None]
        if len(values) >= 3:
            med = median(values)
            scale = max(MAD_TO_SIGMA * mad(values, med), cfg.rel_scale_floor * abs(med), 1e-12)
            metrics[metric] = MetricBaseline(med, scale, len(values))
    components: dict[str, float] = {}
    for comp in COMPONENTS:
        values = [v for s in samples if (v := getattr(s, comp)) is not None]
        if values:
            components[comp] = sum(values) / len(values)
    return Baseline(
        run=run,
        fingerprint=fingerprint,
        first_step=min(s.first_step for s in samples),
        last_step=max(s.step for s in samples),
        step_time_s=median([s.step_time_s for s in samples]),
        metrics=metrics,
        components=components,
    )


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
    return _freeze(eligible, run, fingerprint, cfg)


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
        for comp in COMPONENTS:
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
                self._baseline = _freeze(self._pending, self.run, self.fingerprint, cfg)
                self._pending = []
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
        return events

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
        det._skipped = int(state.get("skipped", 0))
        for metric, raw in dict(state.get("cusum", {})).items():
            if metric in det._cusum:
                det._cusum[metric] = _Cusum.from_dict(raw)
        return det

    def _k(self, base: MetricBaseline) -> float:
        """Reference value in robust sigmas: half the smallest change worth reporting."""
        cfg = self.config
        return min(max(cfg.k, 0.5 * cfg.min_change * abs(base.median) / base.scale), 0.9 * cfg.clip_z)

    def _finding(self, metric: str, st: _Cusum, status: Status) -> Finding:
        assert self._baseline is not None  # findings exist only after the baseline froze
        base = self._baseline
        ref = base.metrics[metric].median
        current = st.value_sum / st.n
        change = (current - ref) / ref if ref else 0.0
        step_now = st.step_time_sum / st.n
        cost_s = max(0.0, step_now - base.step_time_s)
        cost_ratio = max(0.0, METRICS[metric] * change)
        deltas = {
            c: st.comp_sum[c] / st.comp_n[c] - base.components[c]
            for c in COMPONENTS
            if st.comp_n.get(c) and c in base.components
        }
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
        evidence.update({f"delta_{c}": d for c, d in deltas.items()})
        if metric == "mfu":
            head = f"MFU {fmt.signed_pct(change)}"
            values = f"({fmt.pct(ref)} -> {fmt.pct(current)})"
        else:
            head = f"Step time {fmt.signed_pct(change)}"
            values = f"({fmt.secs(ref)} -> {fmt.secs(current)})"
        when = f"from step {fmt.step(st.start_step)}"
        if status == "closed":
            when += f" to {fmt.step(st.last_step)} (recovered)"
        attribution = attribute(deltas, base.step_time_s * self.config.unchanged_ratio)
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


def attribute(deltas: Mapping[str, float], unchanged_s: float) -> str:
    """Name the breakdown component whose time grew most, and say what did not move.

    ``deltas`` maps component to (regression mean - baseline mean) in seconds per step;
    a change smaller than ``unchanged_s`` reads "unchanged".
    """
    if not deltas:
        return "no time breakdown to attribute it"
    thr = max(unchanged_s, 1e-6)
    top = max(deltas, key=lambda c: deltas[c])
    if deltas[top] < thr:
        return "no breakdown component grew (tokens per step or FLOPs may have changed)"
    parts = [f"{COMPONENTS[top]} {fmt.signed_secs(deltas[top])}/step"]
    for comp in sorted(deltas, key=lambda c: -abs(deltas[c])):
        if comp != top and abs(deltas[comp]) >= thr and len(parts) < 3:
            parts.append(f"{COMPONENTS[comp]} {fmt.signed_secs(deltas[comp])}/step")
    # Say what did not move, data wait first: it is the first thing people suspect.
    unchanged = [
        COMPONENTS[c]
        for c in ("data_wait_s", "comm_exposed_s", "compute_s")
        if c in deltas and abs(deltas[c]) < thr
    ]
    if unchanged:
        parts.append(f"{unchanged[0]} unchanged")
    return "; ".join(parts)


@dataclass(frozen=True, slots=True)
class RunComparison:
    """A run's series against a named baseline run with the same config fingerprint."""

    run: str
    baseline_run: str
    fingerprint: str | None
    samples: int
    change: Mapping[str, float]
    component_deltas: Mapping[str, float]
    findings: tuple[Finding, ...]
    message: str


def compare_runs(
    samples: Iterable[JobStep],
    baseline: Baseline,
    *,
    run: str,
    fingerprint: str | None,
    config: RegressionConfig | None = None,
) -> RunComparison:
    """Compare a run with a baseline run: median change per metric, component deltas, and
    the regressions a detector seeded with that baseline finds over the series.

    Raises :class:`FingerprintMismatchError` when the fingerprints differ.
    """
    cfg = config or RegressionConfig()
    det = RegressionDetector(run, cfg, baseline=baseline, fingerprint=fingerprint)
    eligible = [s for s in samples if is_eligible(s)]
    closed = [f for f in det.extend(eligible) if f.status == "closed"]
    findings = tuple(closed + det.open_findings())
    change: dict[str, float] = {}
    for metric, base in baseline.metrics.items():
        values = [v for s in eligible if (v := metric_value(s, metric)) is not None]
        if values and base.median:
            change[metric] = (median(values) - base.median) / base.median
    deltas: dict[str, float] = {}
    for comp in COMPONENTS:
        values = [v for s in eligible if (v := getattr(s, comp)) is not None]
        if values and comp in baseline.components:
            deltas[comp] = sum(values) / len(values) - baseline.components[comp]
    parts = []
    if "mfu" in change:
        parts.append(f"MFU {fmt.signed_pct(change['mfu'])}")
    if "step_time" in change:
        parts.append(f"step time {fmt.signed_pct(change['step_time'])}")
    summary = ", ".join(parts) or "no comparable metric"
    thr = baseline.step_time_s * cfg.unchanged_ratio
    if any(abs(d) >= thr for d in deltas.values()):
        attribution = attribute(deltas, thr)
    else:
        attribution = "time breakdown unchanged" if deltas else ""
    message = f"Run {run} vs baseline {baseline.run}: {summary}"
    message += f"; {attribution}." if attribution else "."
    return RunComparison(
        run=run,
        baseline_run=baseline.run,
        fingerprint=fingerprint,
        samples=len(eligible),
        change=change,
        component_deltas=deltas,
        findings=findings,
        message=message,
    )
