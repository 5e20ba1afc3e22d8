"""Robust location and scale: median, MAD and a floored robust z-score.

Straggler and regression flags must not be moved by the outliers they look for, nor by a
GC pause in one window, so location is the median and scale the median absolute deviation
(MAD) scaled by 1.4826, which equals the standard deviation for normal data.

The scale has a floor: ``max(1.4826 * MAD, rel_floor * |median|, abs_floor)``. Without it,
identical peers (eight GPUs of one host reporting the same compute time to the
microsecond) give MAD = 0 and an infinite z for a 0.1% difference. The relative floor
(default 1% of the median) says "differences below a few percent are never
significant, however quiet the peers"; the absolute floor (seconds) covers quantities
whose median is near zero, such as data-loader wait, where a relative floor vanishes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

#: MAD of a normal distribution times this is its standard deviation.
MAD_TO_SIGMA = 1.4826


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence (mean of the middle two for an even count)."""
    n = len(values)
    if n == 0:
        raise ValueError("median of an empty sequence")
    ordered = sorted(values)
    mid = n // 2
    if n % 2:
        return float(ordered[mid])
    return (ordered[mid - 1] + ordered[mid]) / 2.0


def mad(values: Sequence[float], center: float | None = None) -> float:
    """Median absolute deviation from ``center`` (the median when not given)."""
    c = median(values) if center is None else center
    return median([abs(v - c) for v in values])


@dataclass(frozen=True, slots=True)
class RobustStats:
    """Median, MAD and the floored scale of one set of values."""

    median: float
    mad: float
    scale: float
    n: int

    def z(self, x: float) -> float:
        """Robust z-score of ``x``: distance from the median in floored robust sigmas."""
        return (x - self.median) / self.scale

    def ratio(self, x: float, floor: float) -> float:
        """``x`` over the median, the median floored at ``floor`` so zero is finite."""
        return x / max(self.median, floor)


def robust_stats(values: Iterable[float], *, rel_floor: float = 0.01, abs_floor: float = 1e-3) -> RobustStats:
    """Median, MAD and scale ``max(1.4826 MAD, rel_floor |median|, abs_floor)``.

    ``abs_floor`` must be positive so that the scale, and therefore every z-score, is
    finite whatever the data.
    """
    if abs_floor <= 0.0 or rel_floor < 0.0:
        raise ValueError("abs_floor must be > 0 and rel_floor >= 0")
    vals = [float(v) for v in values]
    if any(not math.isfinite(v) for v in vals):
        raise ValueError("robust_stats needs finite values")
    med = median(vals)
    dev = mad(vals, med)
    scale = max(MAD_TO_SIGMA * dev, rel_floor * abs(med), abs_floor)
    return RobustStats(median=med, mad=dev, scale=scale, n=len(vals))


def clip(x: float, bound: float) -> float:
    """``x`` limited to ``[-bound, bound]``."""
    return max(-bound, min(bound, x))
