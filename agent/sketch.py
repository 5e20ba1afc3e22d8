"""A mergeable log-bucketed quantile sketch with a stated relative error (DDSketch-style).

Why this shape: the agent summarises every collective of a profiler window per
operation type, the collector merges those summaries across windows and ranks and
asks for p50/p99. Raw samples would not fit the storage budget, and averaging
per-window quantiles is wrong. Log buckets merge exactly (add the counts) and
answer any quantile within a relative error ``alpha`` that holds for every input
distribution, which is the guarantee DDSketch (Masson, Rim, Lee, VLDB 2019) gives.

Mapping: ``gamma = (1 + alpha) / (1 - alpha)``; a value ``x > MIN_VALUE`` goes to
bucket ``k = ceil(log_gamma(x))``, i.e. ``gamma**(k-1) < x <= gamma**k``; the bucket
is reported as ``2 * gamma**k / (gamma + 1)``, which is within ``alpha`` of every
value in it. Values ``<= MIN_VALUE`` (zero durations) go to a separate zero bucket.
Count, sum, min and max are kept exactly.

Quantile definition: the *lower* quantile. ``quantile(q)`` answers for the element
of rank ``floor(q * (count - 1))`` (0-based) of the sorted input, within relative
error ``alpha``, and the answer is clamped to ``[min, max]``; ``quantile(0)`` and
``quantile(1)`` are therefore exactly the min and max.

Bounds: at most :data:`MAX_BUCKETS` buckets are kept. Should the values span more
than that (about 35 decades at 1%), the lowest buckets are folded into the lowest
kept one, which keeps the high quantiles (the ones that matter for latency) exact
to ``alpha``; folding depends only on the final range, so it does not break the
equality of ``merge`` with the sketch of the concatenated input.

No third-party import: the collector imports this module too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeGuard

__all__ = ["MAX_BUCKETS", "MIN_VALUE", "LogSketch"]

MIN_VALUE = 1e-9
"""Values at or below this go to the zero bucket (1 ns when the unit is seconds)."""

MAX_VALUE = 1e300
"""Larger finite values are accepted but share the top bucket (keeps gamma**k finite)."""

MAX_BUCKETS = 4096
"""Most buckets a sketch keeps, and most that :meth:`LogSketch.from_dict` accepts."""

MIN_ALPHA = 1e-4
MAX_ALPHA = 0.5
_MAX_COUNT = 2**63 - 1
_FIELDS = ("alpha", "offset", "counts", "zero", "count", "sum", "min", "max")


def _is_int(v: object) -> TypeGuard[int]:
    """JSON integers only: ``bool`` is an ``int`` to Python but not a count."""
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: object) -> TypeGuard[int | float]:
    return isinstance(v, int | float) and not isinstance(v, bool)


class LogSketch:
    """Quantile sketch with relative accuracy ``alpha``; see the module docstring."""

    __slots__ = (
        "_alpha",
        "_bins",
        "_count",
        "_gamma",
        "_hi",
        "_inv_log_gamma",
        "_key_hi",
        "_lo",
        "_log_gamma",
        "_max",
        "_min",
        "_sum",
        "_zero",
    )

    def __init__(self, alpha: float = 0.01) -> None:
        self._alpha = _valid_alpha(alpha)
        self._gamma = (1.0 + self._alpha) / (1.0 - self._alpha)
        self._log_gamma = math.log(self._gamma)
        self._inv_log_gamma = 1.0 / self._log_gamma
        # The highest key any value maps to (``_checked`` bounds a document's keys too).
        self._key_hi = _key_range(self._alpha)[1]
        self._bins: dict[int, int] = {}
        self._lo = 0  # lowest and highest key in _bins (meaningless while _bins is empty)
        self._hi = 0
        self._zero = 0
        self._count = 0
        self._sum = 0.0
        self._min = math.inf
        self._max = -math.inf

    # -- read-only state -------------------------------------------------------------
    @property
    def alpha(self) -> float:
        """Relative accuracy of every quantile answer."""
        return self._alpha

    @property
    def count(self) -> int:
        """Number of values added (exact)."""
        return self._count

    @property
    def sum(self) -> float:
        """Sum of the values added."""
        return self._sum

    @property
    def min(self) -> float:
        """Smallest value added (``inf`` while empty, the identity of ``min``)."""
        return self._min

    @property
    def max(self) -> float:
        """Largest value added (``-inf`` while empty)."""
        return self._max

    @property
    def zero_count(self) -> int:
        """How many values were ``<= MIN_VALUE``."""
        return self._zero

    def buckets(self) -> dict[int, int]:
        """A copy of the non-empty buckets, key -> count, in key order."""
        return {k: self._bins[k] for k in sorted(self._bins)}

    def __repr__(self) -> str:
        return f"LogSketch(alpha={self._alpha}, count={self._count}, buckets={len(self._bins)})"

    # -- updates ---------------------------------------------------------------------
    def key(self, x: float) -> int:
        """The bucket key of a value ``x > MIN_VALUE``."""
        k = math.ceil(math.log(x) * self._inv_log_gamma)
        return k if k < self._key_hi else self._key_hi

    def add(self, x: float, count: int = 1) -> None:
        """Add ``count`` copies of ``x``; ``x`` must be finite and ``>= 0``."""
        if not _is_int(count) or count < 0:
            raise ValueError(f"count must be a non-negative integer, got {count!r}")
        if count == 0:
            return
        x = float(x)
        if not (0.0 <= x < math.inf):  # also rejects NaN
            raise ValueError(f"value must be finite and >= 0, got {x!r}")
        if x <= MIN_VALUE:
            self._zero += count
        else:
            self._add_key(self.key(x), count)
        self._count += count
        self._sum += x * count
        if x < self._min:
            self._min = x
        if x > self._max:
            self._max = x

    def _add_key(self, k: int, count: int) -> None:
        bins = self._bins
        if not bins:
            self._lo = self._hi = k
        elif k > self._hi:
            self._hi = k
        elif k < self._lo:
            self._lo = k
        bins[k] = bins.get(k, 0) + count
        if self._hi - self._lo >= MAX_BUCKETS:
            self._fold()

    def _fold(self) -> None:
        """Keep the key span below MAX_BUCKETS by folding the lowest keys into the lowest kept one.

        Every count ends at ``max(k, hi - MAX_BUCKETS + 1)`` whatever the order of
        the updates, so folding keeps ``merge`` equal to the sketch of the
        concatenated input.
        """
        floor = self._hi - MAX_BUCKETS + 1
        bins = self._bins
        moved = 0
        for k in [k for k in bins if k < floor]:
            moved += bins.pop(k)
        if moved:
            bins[floor] = bins.get(floor, 0) + moved
        self._lo = floor

    def merge(self, other: LogSketch) -> None:
        """Add every value summarised by ``other``; exact (bucket counts add)."""
        if not isinstance(other, LogSketch):
            raise TypeError(f"can only merge a LogSketch, got {type(other).__name__}")
        if other._alpha != self._alpha:
            raise ValueError(f"cannot merge sketches of different alpha: {self._alpha} vs {other._alpha}")
        if other._count == 0:
            return
        bins = self._bins
        if other._bins:
            if not bins:
                self._lo, self._hi = other._lo, other._hi
            else:
                self._lo = min(self._lo, other._lo)
                self._hi = max(self._hi, other._hi)
            for k, c in other._bins.items():
                bins[k] = bins.get(k, 0) + c
            if self._hi - self._lo >= MAX_BUCKETS:
                self._fold()
        self._zero += other._zero
        self._count += other._count
        self._sum += other._sum
        self._min = min(self._min, other._min)
        self._max = max(self._max, other._max)

    # -- queries ---------------------------------------------------------------------
    def value(self, k: int) -> float:
        """The representative value of bucket ``k`` (within ``alpha`` of all its members)."""
        return 2.0 * math.exp(k * self._log_gamma) / (self._gamma + 1.0)

    def quantile(self, q: float) -> float | None:
        """The lower ``q``-quantile within relative error ``alpha``; ``None`` when empty."""
        if not _is_real(q) or not (0.0 <= float(q) <= 1.0):
            raise ValueError(f"q must be a number in [0, 1], got {q!r}")
        if self._count == 0:
            return None
        if q == 0.0:
            return self._min
        if q == 1.0:
            return self._max
        rank = math.floor(float(q) * (self._count - 1))
        if rank < self._zero:
            est = 0.0
        else:
            seen = self._zero
            est = self._max
            for k in sorted(self._bins):
                seen += self._bins[k]
                if seen > rank:
                    est = self.value(k)
                    break
        return min(max(est, self._min), self._max)

    # -- wire format -----------------------------------------------------------------
    def to_dict(self) -> dict[str, object]:
        """Compact JSON-ready form: dense counts from ``offset``; min/max are null while empty."""
        if self._bins:
            lo = self._lo
            counts = [self._bins.get(k, 0) for k in range(lo, self._hi + 1)]
        else:
            lo, counts = 0, []
        empty = self._count == 0
        return {
            "alpha": self._alpha,
            "offset": lo,
            "counts": counts,
            "zero": self._zero,
            "count": self._count,
            "sum": self._sum,
            "min": None if empty else self._min,
            "max": None if empty else self._max,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> LogSketch:
        """Rebuild a sketch from :meth:`to_dict` output, validating it as untrusted input.

        Raises ``ValueError`` naming the offending field: unknown or missing keys,
        wrong types, NaN or infinite numbers, negative counts, more than
        :data:`MAX_BUCKETS` buckets, keys outside the representable range, or a
        ``count`` that is not ``zero + sum(counts)``.
        """
        v = _checked(d)
        sk = cls(v.alpha)
        bins = {v.offset + i: int(c) for i, c in enumerate(v.counts) if c}
        sk._bins = bins
        if bins:
            sk._lo, sk._hi = min(bins), max(bins)
        if v.count:
            sk._min, sk._max = v.min, v.max
        sk._zero = v.zero
        sk._count = v.count
        sk._sum = v.sum
        return sk

    @staticmethod
    def check(d: Mapping[str, object]) -> None:
        """Validate ``d`` as :meth:`from_dict` does, with the same errors, without building
        the sketch: the collector checks the sketch of every collective it is sent and
        keeps the document, and building the bucket map was half of that."""
        _checked(d)


def _valid_alpha(alpha: object) -> float:
    """``alpha`` as a float, if it is a number in [MIN_ALPHA, MAX_ALPHA]."""
    if not _is_real(alpha) or not (MIN_ALPHA <= float(alpha) <= MAX_ALPHA):
        raise ValueError(f"alpha must be a number in [{MIN_ALPHA}, {MAX_ALPHA}], got {alpha!r}")
    return float(alpha)


def _key_range(alpha: float) -> tuple[int, int]:
    """The lowest and highest bucket key any value can map to at ``alpha``."""
    inv_log_gamma = 1.0 / math.log((1.0 + alpha) / (1.0 - alpha))
    return (
        math.ceil(math.log(MIN_VALUE) * inv_log_gamma) - 1,
        math.ceil(math.log(MAX_VALUE) * inv_log_gamma) + 1,
    )


@dataclass(frozen=True)
class _Fields:
    """A sketch document's fields, checked (:func:`_checked`)."""

    alpha: float
    offset: int
    counts: Sequence[int]
    zero: int
    count: int
    sum: float
    min: float
    max: float


def _checked(d: Mapping[str, object]) -> _Fields:
    """The fields of a :meth:`LogSketch.to_dict` document, validated as untrusted input
    (see :meth:`LogSketch.from_dict`); ``min`` and ``max`` are meaningful only when
    ``count`` is not 0."""
    if not isinstance(d, Mapping):
        raise ValueError(f"sketch must be an object, got {type(d).__name__}")
    missing = [f for f in _FIELDS if f not in d]
    if missing:
        raise ValueError(f"sketch field {missing[0]!r} is missing")
    extra = sorted(str(k) for k in d if k not in _FIELDS)
    if extra:
        raise ValueError(f"sketch field {extra[0]!r} is not allowed")

    alpha = d["alpha"]
    if not _is_real(alpha) or not math.isfinite(float(alpha)):
        raise ValueError("sketch field 'alpha' must be a finite number")
    try:
        alpha = _valid_alpha(float(alpha))
    except ValueError as exc:
        raise ValueError(f"sketch field 'alpha' is invalid: {exc}") from None
    key_lo, key_hi = _key_range(alpha)

    offset = d["offset"]
    if not _is_int(offset):
        raise ValueError("sketch field 'offset' must be an integer")
    off = int(offset)
    counts = d["counts"]
    if not isinstance(counts, list | tuple):
        raise ValueError("sketch field 'counts' must be a list of integers")
    if len(counts) > MAX_BUCKETS:
        raise ValueError(f"sketch field 'counts' has {len(counts)} buckets, more than {MAX_BUCKETS}")
    if counts and (off < key_lo or off + len(counts) - 1 > key_hi):
        raise ValueError(f"sketch field 'offset' puts buckets outside [{key_lo}, {key_hi}] for this alpha")
    # The common case checked at C speed (a collector validates one sketch per
    # collective op of every window); item by item only to name a bad one.
    if counts and not (set(map(type, counts)) == {int} and min(counts) >= 0 and max(counts) <= _MAX_COUNT):
        for i, c in enumerate(counts):
            if not _is_int(c) or not (0 <= c <= _MAX_COUNT):
                raise ValueError(f"sketch field 'counts' item {i} must be an integer in [0, 2**63)")
    binned = sum(counts)

    def count_field(name: str) -> int:
        v = d[name]
        if not _is_int(v) or not (0 <= v <= _MAX_COUNT):
            raise ValueError(f"sketch field {name!r} must be an integer in [0, 2**63)")
        return int(v)

    zero = count_field("zero")
    count = count_field("count")
    if count != zero + binned:
        raise ValueError("sketch field 'count' is not equal to 'zero' plus the sum of 'counts'")

    def real_field(name: str) -> float | None:
        v = d[name]
        if v is None:
            return None
        if not _is_real(v) or not math.isfinite(float(v)):
            raise ValueError(f"sketch field {name!r} must be a finite number")
        return float(v)

    total_ = real_field("sum")
    lo = real_field("min")
    hi = real_field("max")
    if total_ is None or total_ < 0.0:
        raise ValueError("sketch field 'sum' must be a finite number >= 0")
    if count == 0:
        if lo is not None or hi is not None or total_ != 0.0:
            raise ValueError("sketch field 'min' and 'max' must be null and 'sum' 0 when 'count' is 0")
        return _Fields(alpha, off, counts, zero, count, total_, math.inf, -math.inf)
    if lo is None or hi is None:
        raise ValueError(f"sketch field {'min' if lo is None else 'max'!r} must be a number")
    if lo < 0.0:
        raise ValueError("sketch field 'min' must be >= 0")
    if hi < lo:
        raise ValueError("sketch field 'max' is smaller than 'min'")
    if zero and lo > MIN_VALUE:
        raise ValueError("sketch field 'min' is above MIN_VALUE while 'zero' counts values")
    if binned and hi <= MIN_VALUE:
        raise ValueError("sketch field 'max' is at most MIN_VALUE while 'counts' is not empty")
    return _Fields(alpha, off, counts, zero, count, total_, lo, hi)
