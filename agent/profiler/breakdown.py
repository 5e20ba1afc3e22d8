"""Time breakdown of one training step from activity intervals (DESIGN §3).

A step on one rank splits into disjoint parts that sum to the step time:

``data_wait_s``
    The host is blocked in the data loader.
``comm_overlapped_s``
    Communication runs while compute runs too (the communication is hidden).
``compute_s``
    Compute kernels run and no communication does (*compute only*: the overlapped
    part is not counted again here). Kernels only, as HTA defines compute.
``copy_s``
    Only memory copies and sets run (``gpu_memcpy``/``gpu_memset``: no kernel, no
    communication). The device is busy but not computing; 0 on the CPU path.
``comm_exposed_s``
    Communication runs and nothing else does: the rank waits on the network.
``idle_s``
    Everything else: launch gaps, host overhead, pipeline bubbles, synchronisation.

Precedence, applied in this order, decides where a moment that belongs to several
activities goes. Every interval is first clipped to the step span.

1. Data wait wins over everything: a moment in which the host is blocked in the
   loader is data wait even if a collective of the previous step is still
   draining. The loader is the thing to fix first, and counting the moment twice
   would break the sum.
2. Of what remains, communication while the device does other work (compute or
   copies) is *overlapped* communication.
3. Compute without communication is *compute only*; a copy that runs beside a
   kernel is inside it.
4. Copies with neither compute nor communication are *copies*.
5. Communication without compute or copies is *exposed* communication.
6. Idle is the remainder of the step, so the parts sum to the step time by
   construction (up to one floating-point rounding, never below zero).

The overlap ratio is overlapped / (overlapped + exposed): the share of the
communication time (outside data wait) that compute hid. It is ``None`` when the
step had no communication, because 0/0 is not a ratio.

All functions here are pure and work on plain ``(start, end)`` pairs in any one
unit; the interval operations are O(n log n) for the sort and linear after it.
This module imports nothing from torch so that the collector and tests can use it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "Interval",
    "StepBreakdown",
    "breakdown",
    "clip",
    "intersect",
    "subtract",
    "total",
    "union",
]

Interval = tuple[float, float]


def _check(iv: Interval) -> None:
    if not (math.isfinite(iv[0]) and math.isfinite(iv[1])):
        raise ValueError(f"interval bounds must be finite, got {iv!r}")


def union(*interval_sets: Iterable[Interval]) -> list[Interval]:
    """The union of any number of interval collections as a sorted, disjoint list.

    Empty and reversed intervals (``end <= start``) are dropped; touching
    intervals are merged, so the result is the canonical form every other
    operation here expects. Non-finite bounds raise ``ValueError``: a NaN would
    silently poison every later sum.
    """
    items: list[Interval] = []
    for intervals in interval_sets:
        for iv in intervals:
            _check(iv)
            if iv[1] > iv[0]:
                items.append((float(iv[0]), float(iv[1])))
    if not items:
        return []
    items.sort()
    out: list[Interval] = []
    cur_s, cur_e = items[0]
    for s, e in items[1:]:
        if s <= cur_e:
            if e > cur_e:
                cur_e = e
        else:
            out.append((cur_s, cur_e))
            cur_s, cur_e = s, e
    out.append((cur_s, cur_e))
    return out


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """Intersection of two canonical (sorted, disjoint) interval lists, by a linear merge."""
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        s = max(a[i][0], b[j][0])
        e = min(a[i][1], b[j][1])
        if e > s:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """``a`` minus ``b`` for canonical interval lists, by a linear merge."""
    out: list[Interval] = []
    j = 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            if cur >= e:
                break
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def clip(a: Sequence[Interval], lo: float, hi: float) -> list[Interval]:
    """The parts of canonical list ``a`` that lie inside ``[lo, hi]``."""
    return intersect(a, [(lo, hi)]) if hi > lo else []


def total(a: Iterable[Interval]) -> float:
    """Summed length of a canonical (disjoint) interval list."""
    return math.fsum(e - s for s, e in a)


@dataclass(frozen=True)
class StepBreakdown:
    """One step's time split into disjoint parts, in seconds (see the module docstring)."""

    step_s: float
    compute_s: float
    comm_overlapped_s: float
    comm_exposed_s: float
    data_wait_s: float
    idle_s: float
    copy_s: float = 0.0

    @property
    def comm_s(self) -> float:
        """All communication time counted in this step (overlapped + exposed)."""
        return self.comm_overlapped_s + self.comm_exposed_s

    @property
    def overlap_ratio(self) -> float | None:
        """Overlapped / total communication, or ``None`` when there was no communication."""
        comm = self.comm_s
        if comm <= 0.0:
            return None
        return self.comm_overlapped_s / comm

    def scaled(self, factor: float) -> StepBreakdown:
        """The same breakdown with every part multiplied by ``factor`` (unit conversion)."""
        return StepBreakdown(
            step_s=self.step_s * factor,
            compute_s=self.compute_s * factor,
            comm_overlapped_s=self.comm_overlapped_s * factor,
            comm_exposed_s=self.comm_exposed_s * factor,
            data_wait_s=self.data_wait_s * factor,
            idle_s=self.idle_s * factor,
            copy_s=self.copy_s * factor,
        )


def breakdown(
    step: Interval,
    compute: Sequence[Interval],
    comm: Sequence[Interval],
    data_wait: Sequence[Interval],
    copies: Sequence[Interval] = (),
) -> StepBreakdown:
    """Split ``step`` into compute-only, copies, overlapped and exposed communication,
    data wait and idle.

    The inputs may overlap among themselves, be unsorted and extend past the step:
    each collection is reduced to its union and clipped to the step span first.
    The result is in the unit of the inputs (callers convert, see
    :meth:`StepBreakdown.scaled`). To keep precision when the timestamps are large
    (profiler clocks in microseconds since boot), everything is shifted so that the
    step starts at zero before any length is taken.
    """
    _check(step)
    s0, s1 = float(step[0]), float(step[1])
    if s1 < s0:
        raise ValueError(f"step ends before it starts: {step!r}")
    length = s1 - s0
    if length == 0.0:
        return StepBreakdown(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)

    def rel(intervals: Sequence[Interval]) -> list[Interval]:
        return clip(union((s - s0, e - s0) for s, e in intervals), 0.0, length)

    wait = rel(data_wait)
    busy = subtract(rel(compute), wait)
    moving = subtract(subtract(rel(copies), wait), busy)  # copies beside no kernel
    net = subtract(rel(comm), wait)
    other = union(busy, moving)
    overlapped = total(intersect(other, net))
    compute_only = total(subtract(busy, net))
    copy_only = total(subtract(moving, net))
    exposed = total(subtract(net, other))
    waited = total(wait)
    idle = max(0.0, length - (waited + overlapped + compute_only + copy_only + exposed))
    return StepBreakdown(
        step_s=length,
        compute_s=compute_only,
        comm_overlapped_s=overlapped,
        comm_exposed_s=exposed,
        data_wait_s=waited,
        idle_s=idle,
        copy_s=copy_only,
    )
