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

Events live in at most :data:`GENERATIONS` *generations*, each with a slot per slot of
the hook's host arrays (``capacity × MAX_BUCKETS``). A slot's pair of events is made at
its first use in a generation and reused after, so the events made are bounded by the
slots a run's windows use, three times over, and a generation costs two lists of
``None`` until then (``torch.cuda.Event`` is a small object; its CUDA event is created at
its first record). A window's close hands its generation to the sender with the window
and continues on a free one; the generation comes back once the sender has read it, or
when the window is dropped unread (a ``weakref.finalize`` on its slots: a deque append,
atomic in CPython, no lock), so an event is never re-recorded while the sender may read
it. A window closed while no generation is free (the sender far behind) is timed on the
host clock. Each use of a generation marks the slots it recorded: a reused slot still
holds an earlier window's records, which must never be read as this one's. Reading uses
``query()`` and ``elapsed_time()`` only, never ``synchronize()``: a window whose events
have not all completed keeps its host times (:func:`resolve` returns None) and its
section says ``"clock": "host"``.
"""

from __future__ import annotations

import weakref
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ._device_clock import DeviceEvent

#: Generations in all: one the hook records into, one the sender reads, one queued.
GENERATIONS = 3


@dataclass
class Generation:
    """One window's worth of event slots (slot ``b * capacity + i``, as the host arrays)."""

    arrive: list[DeviceEvent | None]
    end: list[DeviceEvent | None]
    #: 1 where this use recorded the slot's arrival and its end did not fail to record.
    recorded: bytearray


#: What the hook's ``then()`` callback records at a bucket's end: (the event, the
#: generation's marks, the slot), so that a failed record unmarks the slot.
DeviceEnd = tuple[DeviceEvent, bytearray, int]


@dataclass
class DeviceSlots:
    """One window's device events, handed to the sender with its :class:`TimingSlices`."""

    generation: Generation
    #: The hook's slot stride (the agent's window capacity).
    capacity: int
    #: Gives the generation back for reuse, once (read, or dropped unread).
    release: Callable[[], object] = field(default=lambda: None)


class CommEvents:
    """The arrival and end events of the hook's slots, in a bounded set of generations."""

    def __init__(self, slots: int, capacity: int, make_event: Callable[[], DeviceEvent]) -> None:
        self._slots = slots
        self._capacity = capacity
        self._make = make_event
        self._zeros = bytes(slots)
        self._free: deque[Generation] = deque(self._new() for _ in range(GENERATIONS - 1))
        self._gen: Generation | None = self._new()

    def _new(self) -> Generation:
        return Generation([None] * self._slots, [None] * self._slots, bytearray(self._slots))

    def record_arrival(self, k: int) -> DeviceEnd | None:
        """Hot path (in the hook): record slot ``k``'s arrival on the current stream and
        return its end event, for the ``then()`` callback to record (None: no generation
        free, this window is on the host clock)."""
        g = self._gen
        if g is None:
            return None
        a = g.arrive[k]
        if a is None:  # first use of the slot in this generation: made once
            a = g.arrive[k] = self._make()
        e = g.end[k]
        if e is None:
            e = g.end[k] = self._make()
        a.record()
        g.recorded[k] = 1
        return e, g.recorded, k

    def take(self) -> DeviceSlots | None:
        """Window close (training thread): hand this generation over, continue on a free
        one (none free: the next window is timed on the host clock)."""
        g = self._gen
        try:
            nxt: Generation | None = self._free.popleft()
        except IndexError:
            nxt = None
        if nxt is not None:
            nxt.recorded[:] = self._zeros  # marks of its earlier use
        self._gen = nxt
        if g is None:
            return None
        slots = DeviceSlots(g, self._capacity)
        slots.release = weakref.finalize(slots, self._free.append, g)
        return slots


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
    Returns None unless every event needed was recorded in this window and has completed
    (``query()``, which never blocks): the caller then keeps the whole window on the host
    clock, so that one window never mixes device offsets with launch times. Gives the
    generation back either way.
    """
    try:
        g = slots.generation
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
                j = b * cap + i
                a, e = g.arrive[j], g.end[j]
                if not g.recorded[j] or a is None or e is None or not (a.query() and e.query()):
                    return None
                arrive[k] = start.elapsed_time(a) / 1000.0
                end[k] = start.elapsed_time(e) / 1000.0
        return arrive, end
    except Exception:  # an event never recorded (its record failed): this window keeps host times
        return None
    finally:
        slots.release()


def cuda_event_factory() -> Callable[[], DeviceEvent] | None:
    """``torch.cuda.Event(enable_timing=True)`` where CUDA works, else None."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
    except Exception:
        return None
    return lambda: torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
