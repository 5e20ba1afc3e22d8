"""The communication hook's device clock: CUDA events per bucket, read back off the hot path.

Why: on a GPU the hook runs when autograd *launches* the bucket's last gradient kernel,
and a CUDA future's ``then()`` callback runs as soon as NCCL has *queued* the all-reduce
(``Future.done()`` is true while the kernels still run). Host times there are launch
times: a rank whose device is slow launches on time and looks punctual. The device's
own arrival and end are what the collective waits for, so this records two events per
bucket, read back later on the sender thread:

- *arrival*: recorded in the hook on the current stream, the stream the bucket's gradient
  kernels ran on, which the collective itself waits for;
- *end*: recorded in the ``then()`` callback, on the dedicated stream torch makes current
  there and synchronises with the future's kernels (``torch.futures.Future.then``), so it
  completes when the all-reduce (and any decompression of the user's hook) has ended on
  the device.

Per-step offsets are measured from the step's start on the device: the agent's step
boundary event (``_device_clock.CudaEventClock``), recorded by ``sw.step()`` anyway.

Events are preallocated in *generations*: one event pair per slot of the hook's host
arrays (``capacity × MAX_BUCKETS``). A window's close hands its generation to the sender
with the window and continues on a spare; the sender gives the generation back once it
has read it (a deque append and pop, atomic in CPython: no lock), so an event is never
re-recorded while the sender may still read it, and steady state allocates nothing. Only
while no generation has come back (the first windows, or a sender far behind) does a
window close allocate one (``torch.cuda.Event`` is a small object; its CUDA event is
created at its first record). Reading uses ``query()`` and ``elapsed_time()`` only, never
``synchronize()``: a window whose events have not all completed keeps its host times
(:func:`resolve` returns None) and its section says ``"clock": "host"``.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ._device_clock import DeviceEvent

#: A generation: (arrival events, end events), slot ``b * capacity + i`` as the host arrays.
Generation = tuple[list[DeviceEvent], list[DeviceEvent]]


@dataclass
class DeviceSlots:
    """One window's device events, handed to the sender with its :class:`TimingSlices`."""

    generation: Generation
    #: The hook's slot stride (the agent's window capacity).
    capacity: int
    #: Where the sender gives the generation back once read.
    pool: CommEvents


class CommEvents:
    """The preallocated arrival and end events of the hook's slots."""

    def __init__(self, slots: int, capacity: int, make_event: Callable[[], DeviceEvent]) -> None:
        self._slots = slots
        self._capacity = capacity
        self._make = make_event
        self._spare: deque[Generation] = deque()
        self.arrive, self.end = self._fresh()

    def _fresh(self) -> Generation:
        return [self._make() for _ in range(self._slots)], [self._make() for _ in range(self._slots)]

    def record_arrival(self, k: int) -> DeviceEvent:
        """Hot path (in the hook): record slot ``k``'s arrival on the current stream and
        return its end event, for the ``then()`` callback to record."""
        self.arrive[k].record()
        return self.end[k]

    def take(self) -> DeviceSlots:
        """Window close (training thread): hand this generation over, continue on a spare."""
        out = DeviceSlots((self.arrive, self.end), self._capacity, self)
        try:
            self.arrive, self.end = self._spare.popleft()
        except IndexError:  # none back yet: the first windows, or a sender far behind
            self.arrive, self.end = self._fresh()
        return out

    def give_back(self, generation: Generation) -> None:
        """Sender thread: the generation's events were read and may be recorded again."""
        if len(self._spare) < 2:  # more would only be spares of spares
            self._spare.append(generation)


def resolve(
    slots: DeviceSlots,
    step_of: Sequence[int],
    n_buckets: Sequence[int],
    host_end: Sequence[float],
    first_step: int,
    starts: Sequence[DeviceEvent | None],
    ends: Sequence[DeviceEvent],
    none: float,
) -> tuple[array[float], array[float]] | None:
    """Device arrival and end of every timed bucket, in seconds after its step's start
    (laid out as the window's host arrays: bucket ``b`` of step ``i`` at ``b * n + i``).

    ``starts[i]`` and ``ends[i]`` are step ``i``'s boundary events on the device (the
    agent's step clock; ``starts[i]`` is None for the run's first step, whose buckets
    then stay untimed: ``none`` in both). Both must have completed, so that the step's
    time beside these offsets is the device's too.
    A bucket whose host end is ``none`` (its collective never completed) stays so too.
    Returns None unless every event needed has completed (``query()``, which never blocks):
    the caller then keeps the whole window on the host clock, so that one window never
    mixes device offsets with launch times. Gives the generation back either way.
    """
    try:
        arrive_ev, end_ev = slots.generation
        cap, n = slots.capacity, len(step_of)
        arrive = array("d", [none]) * len(host_end)
        end = array("d", [none]) * len(host_end)
        for i in range(n):
            nb = n_buckets[i]
            if step_of[i] != first_step + i or nb == 0:
                continue
            start = starts[i]
            if start is None:
                continue
            if not (start.query() and ends[i].query()):
                return None
            for b in range(nb):
                k = b * n + i
                if host_end[k] == none:
                    continue
                a, e = arrive_ev[b * cap + i], end_ev[b * cap + i]
                if not (a.query() and e.query()):
                    return None
                arrive[k] = start.elapsed_time(a) / 1000.0
                end[k] = start.elapsed_time(e) / 1000.0
        return arrive, end
    except Exception:  # an event never recorded (its record failed): this window keeps host times
        return None
    finally:
        slots.pool.give_back(slots.generation)


def cuda_event_factory() -> Callable[[], DeviceEvent] | None:
    """``torch.cuda.Event(enable_timing=True)`` where CUDA works, else None."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
    except Exception:
        return None
    return lambda: torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
