"""The seam between the hot path and device-side timing.

On a GPU the host reaches a step boundary long before the device does (kernels are
queued asynchronously), so host intervals measure the launch loop, not the work. The
device clock records a CUDA event at each step boundary on the hot path (a few hundred
nanoseconds, no synchronisation) and reads the intervals back later, on the sender's
thread, once the events have completed: ``Event.query()`` never blocks, and nothing
here calls ``synchronize()``.

Events belong to the window that recorded them. When a window closes, the hot path
hands its event list to the sender and starts a fresh one, so an event is never
re-recorded while the sender may still read it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol


class DeviceEvent(Protocol):
    """What the device clock needs of ``torch.cuda.Event``."""

    def record(self) -> None: ...

    def query(self) -> bool: ...

    def elapsed_time(self, end_event: Any) -> float: ...


class CudaEventClock:
    """Records one device event per step boundary; resolves them off the hot path."""

    def __init__(self, capacity: int, make_event: Callable[[], DeviceEvent]) -> None:
        self._capacity = capacity
        self._make_event = make_event
        self._prev: DeviceEvent | None = None
        self._events: list[DeviceEvent] = self._fresh()

    def _fresh(self) -> list[DeviceEvent]:
        return [self._make_event() for _ in range(self._capacity)]

    def record(self, i: int) -> None:
        """Hot path: mark the end of the i-th step of the current window."""
        self._events[i].record()

    def take(self, n: int) -> tuple[DeviceEvent | None, list[DeviceEvent]]:
        """Close the window after ``n`` steps; return (previous boundary, boundaries)."""
        events = self._events[:n]
        prev = self._prev
        self._prev = events[-1] if n else prev
        self._events = self._fresh()
        return prev, events

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
