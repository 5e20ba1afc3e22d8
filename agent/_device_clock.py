"""The seam between the hot path and device-side timing.

On a GPU the host reaches a step boundary long before the device does (kernels are
queued asynchronously), so host intervals measure the launch loop, not the work. The
device clock records a CUDA event at each step boundary on the hot path (a few hundred
nanoseconds, no synchronisation) and reads the intervals back later, on the sender's
thread, once the events have completed: ``Event.query()`` never blocks, and nothing
here calls ``synchronize()``.

Events belong to the window that recorded them until the sender has read it. Each slot's
event is made at its first use in a *generation* (a list of ``capacity`` slots) and
reused after, so the events made are bounded by the slots a run's windows use, at most
:data:`GENERATIONS` times over (making ``capacity`` events at every window close on the
training thread was the cost before). A window's close hands its generation's events to
the sender with the window and continues on a free generation; the generation comes
back when the window's list of events is released: read by the sender, or dropped unread
(a ``weakref.finalize``, a deque append: no lock). An event the sender may still read is
never re-recorded. The window's last event, which the next window starts from, leaves
its generation at the close (a new event takes its slot at that slot's next use). A
window closed while no generation is free (the sender far behind) is timed on the host
clock, and so is the first step of the window after it.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast


class DeviceEvent(Protocol):
    """What the device clock needs of ``torch.cuda.Event``."""

    def record(self) -> None: ...

    def query(self) -> bool: ...

    def elapsed_time(self, end_event: Any) -> float: ...


#: Event lists in use at once: the one the hot path records into and those handed to the
#: sender with windows it has not read yet.
GENERATIONS = 3

Generation = list["DeviceEvent | None"]


class Boundaries(list["DeviceEvent"]):
    """A window's step-boundary events. ``release()`` gives their generation back once
    the sender has read them (and the others read with them, the hook's); it runs by
    itself, once, when the list is dropped unread (a plain list cannot be weakly
    referenced)."""

    __slots__ = ("__weakref__", "release")
    release: weakref.finalize[Any, Any]


class CudaEventClock:
    """Records one device event per step boundary; resolves them off the hot path."""

    def __init__(self, capacity: int, make_event: Callable[[], DeviceEvent]) -> None:
        self._capacity = capacity
        self._make_event = make_event
        self._prev: DeviceEvent | None = None
        self._generations = 1
        self._free: deque[Generation] = deque()
        self._events: Generation | None = [None] * capacity

    def record(self, i: int) -> None:
        """Hot path: mark the end of the i-th step of the current window."""
        events = self._events
        if events is None:  # no free generation: this window is timed on the host clock
            return
        ev = events[i]
        if ev is None:  # the slot's first use in this generation: made once
            ev = events[i] = self._make_event()
        ev.record()

    def take(self, n: int) -> tuple[DeviceEvent | None, Boundaries] | None:
        """Close the window after ``n`` steps (training thread): (previous boundary,
        boundaries), or None when it has no step or was timed on the host clock."""
        events, prev = self._events, self._prev
        if n == 0:  # no step: nothing to read, and the generation stays in use
            return None
        if events is None:
            self._prev = None  # no event ends this window: the next one's first step keeps host time
            self._events = self._next()
            return None
        # Every step of the window recorded its slot (a failed record turns the agent off).
        out = Boundaries(cast(list[DeviceEvent], events[:n]))
        self._prev = out[-1]
        events[n - 1] = None  # the next window's start leaves the generation
        out.release = weakref.finalize(out, self._free.append, events)
        self._events = self._next()
        return prev, out

    def _next(self) -> Generation | None:
        """A free generation, a new one while fewer than GENERATIONS exist, else None."""
        try:
            return self._free.popleft()
        except IndexError:
            pass
        if self._generations < GENERATIONS:
            self._generations += 1
            return [None] * self._capacity
        return None

    @staticmethod
    def resolve(
        prev: DeviceEvent | None,
        events: Sequence[DeviceEvent],
        host_times: Sequence[float],
        *,
        deadline_s: float = 5.0,
        poll_s: float = 0.005,
    ) -> list[float]:
        """Step durations in seconds from device events, on the sender's thread.

        Waits (polling ``query()``, which never blocks the device or the training
        thread) until the last event has completed or the deadline passes; steps
        whose events are not complete by then keep their host-clock duration, so a
        stuck device never stalls the sender.
        """
        return CudaEventClock.resolve_all(prev, events, host_times, deadline_s=deadline_s, poll_s=poll_s)[0]

    @staticmethod
    def resolve_all(
        prev: DeviceEvent | None,
        events: Sequence[DeviceEvent],
        host_times: Sequence[float],
        *,
        deadline_s: float = 5.0,
        poll_s: float = 0.005,
    ) -> tuple[list[float], bool]:
        """:meth:`resolve`, and whether every step that has a start on the device (all
        but the run's first) took its duration from the device: what else is read of
        the same steps' events later (the hook's, by ``query()`` alone) may be put beside
        these durations only then, never beside a host duration kept at the deadline."""
        end = time.monotonic() + deadline_s
        while events and not events[-1].query() and time.monotonic() < end:
            time.sleep(poll_s)
        out = list(host_times)
        complete = True
        before = prev
        for i, ev in enumerate(events):
            if before is not None:
                if before.query() and ev.query():
                    out[i] = before.elapsed_time(ev) / 1000.0
                else:
                    complete = False
            before = ev
        return out, complete


def cuda_clock(capacity: int) -> CudaEventClock | None:
    """A device clock when CUDA is initialised in this process, else None (host clock)."""
    try:
        import torch
    except ImportError:
        return None
    try:
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            return None
        return CudaEventClock(
            capacity,
            lambda: torch.cuda.Event(enable_timing=True),  # type: ignore[no-untyped-call]
        )
    except Exception:  # a broken driver must not stop init: fall back to the host clock
        return None
