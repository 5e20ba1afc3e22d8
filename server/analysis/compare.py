"""One run against a named baseline run with the same config fingerprint.

:func:`compare_runs` answers "is this run slower than the reference, and where?": the
median change of each metric over the run, the change of each breakdown part, and the
regressions a detector seeded with the reference's frozen baseline finds along the way
(no warm-up of its own is needed). Runs whose fingerprints differ are not comparable
(:class:`~.baseline.FingerprintMismatchError`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from . import _format as fmt
from .attribution import MEANS, attribute, deltas
from .baseline import Baseline, is_eligible, metric_value
from .regressions import RegressionConfig, RegressionDetector
from .robust import median
from .types import Finding, JobStep


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

    Raises :class:`~.baseline.FingerprintMismatchError` when the fingerprints differ.
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
    means: dict[str, float] = {}
    for comp in MEANS:
        values = [v for s in eligible if (v := getattr(s, comp)) is not None]
        if values:
            means[comp] = sum(values) / len(values)
    moved = deltas(means, baseline.components)
    parts = []
    if "mfu" in change:
        parts.append(f"MFU {fmt.signed_pct(change['mfu'])}")
    if "step_time" in change:
        parts.append(f"step time {fmt.signed_pct(change['step_time'])}")
    summary = ", ".join(parts) or "no comparable metric"
    thr = baseline.step_time_s * cfg.unchanged_ratio
    if any(abs(d) >= thr for d in moved.values()):
        attribution = attribute(moved, thr)
    else:
        attribution = "time breakdown unchanged" if moved else ""
    message = f"Run {run} vs baseline {baseline.run}: {summary}"
    message += f"; {attribution}." if attribution else "."
    return RunComparison(
        run=run,
        baseline_run=baseline.run,
        fingerprint=fingerprint,
        samples=len(eligible),
        change=change,
        component_deltas=moved,
        findings=findings,
        message=message,
    )
