"""A run's frozen baseline: where each job metric sits and how much it moves by itself.

The regression detector (:mod:`.regressions`) compares every later window with this. Two
numbers per metric (MFU, step time):

- **location**: the median over the baseline windows of each window's robust value (the
  median of its per-step samples when the window carries them, so that a few long steps,
  an untagged checkpoint or a GC pause, do not move it);
- **scale**: the baseline's own window-to-window noise, ``max(between, within, floor)``:
  ``between`` is 1.4826 x the MAD of the windows' values (what the job's speed really
  does from one window to the next: load on the host, a slow drift); ``within`` is the
  standard error of one window's median from its per-step spread (1.2533 x sigma / sqrt n),
  a lower bound that keeps a short baseline whose few windows happened to agree from
  calling every later wobble a regression; ``floor`` is ``rel_floor`` of the location
  (changes below it are never significant, however quiet the run).

It also keeps the means of the breakdown parts (compute, exposed communication, data wait,
idle, and the training thread's CPU time where measured) to attribute a regression to the
part that moved (:mod:`.attribution`), and the run's config fingerprint, so that another run
can be compared with it only when the fingerprints match.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .attribution import MEANS
from .robust import MAD_TO_SIGMA, mad, median
from .types import EXCLUDED_TAGS, JobStep

#: Metric name -> +1 when an increase is bad, -1 when a decrease is bad.
METRICS: Mapping[str, float] = {"mfu": -1.0, "step_time": 1.0}
#: Standard error of a median of n normal samples is this times sigma / sqrt(n).
MEDIAN_SE = math.sqrt(math.pi / 2.0)


class FingerprintMismatchError(ValueError):
    """Two runs with different config fingerprints are not comparable."""


@dataclass(frozen=True, slots=True)
class MetricBaseline:
    """Frozen location and scale of one metric (``n``: windows it was formed from)."""

    median: float
    scale: float
    n: int


#: What a baseline's breakdown components mean, kept with them: "critical-path" since
#: the always-on timing's breakdown follows each step's last arriver
#: (:func:`.pipeline.timing_means`); a baseline saved without it (means over all ranks,
#: which count the others' wait as communication) keeps its medians, not its components,
#: so that a later regression is not attributed to the difference of the two methods.
COMPONENTS_BASIS = "critical-path"


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
            "components_basis": COMPONENTS_BASIS,
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
            components=(
                {str(k): float(v) for k, v in dict(data.get("components", {})).items()}
                if data.get("components_basis") == COMPONENTS_BASIS
                else {}
            ),
        )


def metric_value(sample: JobStep, metric: str) -> float | None:
    """The robust value of ``metric`` in a sample (the median of its per-step samples
    when it has them, else its mean), or ``None`` when it is unknown."""
    if metric == "mfu":
        return sample.mfu_median if sample.mfu_median is not None else sample.mfu
    if metric == "step_time":
        if sample.step_time_median_s is not None and sample.step_time_median_s > 0:
            return sample.step_time_median_s
        return sample.step_time_s if sample.step_time_s > 0 else None
    raise ValueError(f"unknown metric {metric!r}")


def within_se(sample: JobStep) -> float | None:
    """Relative standard error of the sample's median step time from its per-step spread
    (MFU moves by the same fraction at constant tokens), or ``None`` without per-step data."""
    if not sample.step_time_spread_s or sample.n_samples < 2 or not sample.step_time_median_s:
        return None
    return MEDIAN_SE * sample.step_time_spread_s / math.sqrt(sample.n_samples) / sample.step_time_median_s


def is_eligible(sample: JobStep) -> bool:
    """Warm-up, checkpoint and evaluation samples are never evidence of a regression."""
    return sample.tag not in EXCLUDED_TAGS


def freeze(samples: Sequence[JobStep], run: str, fingerprint: str | None, rel_floor: float) -> Baseline:
    """The baseline of ``samples`` (eligible windows, in order); see the module docstring."""
    metrics: dict[str, MetricBaseline] = {}
    ses = [se for s in samples if (se := within_se(s)) is not None]
    within_rel = median(ses) if ses else 0.0
    for metric in METRICS:
        values = [v for s in samples if (v := metric_value(s, metric)) is not None]
        if len(values) >= 3:
            med = median(values)
            between = MAD_TO_SIGMA * mad(values, med)
            scale = max(between, within_rel * abs(med), rel_floor * abs(med), 1e-12)
            metrics[metric] = MetricBaseline(med, scale, len(values))
    components: dict[str, float] = {}
    for comp in MEANS:
        vals = [v for s in samples if (v := getattr(s, comp)) is not None]
        if vals:
            components[comp] = sum(vals) / len(vals)
    return Baseline(
        run=run,
        fingerprint=fingerprint,
        first_step=min(s.first_step for s in samples),
        last_step=max(s.step for s in samples),
        step_time_s=median([s.step_time_s for s in samples]),
        metrics=metrics,
        components=components,
    )
