"""The CUDA-event clock's logic, driven by stand-in events.

There is no GPU on the machines this suite runs on, so ``torch.cuda.Event`` cannot be
created here; ``tests/fake_cuda.FakeEvent`` stands in for it (here created incomplete,
as a just-recorded event is). This stands in for the GPU only.
"""

from __future__ import annotations

from typing import Any

import pytest

from stepwatch._device_clock import GENERATIONS, CudaEventClock

from ..fake_cuda import FakeEvent as _Fake


class FakeEvent(_Fake):
    def __init__(self, device: list[float]) -> None:
        super().__init__(device, done=False)


def test_device_durations_replace_host_durations_once_events_complete() -> None:
    device = [0.0]
    made: list[FakeEvent] = []

    def make() -> FakeEvent:
        made.append(FakeEvent(device))
        return made[-1]

    clock = CudaEventClock(4, make)
    for i, step_ms in enumerate([100.0, 120.0, 80.0]):
        device[0] += step_ms
        clock.record(i)
    prev, events = clock.take(3)
    assert prev is None and len(events) == 3
    for ev in events:
        ev.done = True
    # The first step of the first window has no previous device boundary: host time stays.
    out = CudaEventClock.resolve(prev, events, [0.5, 0.5, 0.5], deadline_s=0.0)
    assert out == pytest.approx([0.5, 0.12, 0.08])

    # The next window starts from the previous window's last event, and uses fresh events:
    # nothing the sender may still read is ever re-recorded.
    device[0] += 200.0
    clock.record(0)
    prev2, events2 = clock.take(1)
    assert prev2 is events[-1]
    assert all(ev.records == 1 for ev in made if ev.t is not None)
    events2[0].done = True
    assert CudaEventClock.resolve(prev2, events2, [9.9], deadline_s=0.0) == pytest.approx([0.2])


def test_incomplete_events_keep_host_time_and_never_block() -> None:
    device = [0.0]
    clock = CudaEventClock(2, lambda: FakeEvent(device))
    device[0] += 50.0
    clock.record(0)
    device[0] += 50.0
    clock.record(1)
    prev, events = clock.take(2)
    events[0].done = True  # the last event never completes (a stuck device)
    out = CudaEventClock.resolve(prev, events, [0.7, 0.9], deadline_s=0.01, poll_s=0.001)
    assert out == [0.7, 0.9]


def _clock(cap: int) -> tuple[CudaEventClock, list[FakeEvent], list[float]]:
    device = [0.0]
    made: list[FakeEvent] = []

    def make() -> FakeEvent:
        made.append(FakeEvent(device))
        return made[-1]

    return CudaEventClock(cap, make), made, device


def _window(clock: CudaEventClock, device: list[float], steps: int) -> Any:
    for i in range(steps):
        device[0] += 10.0
        clock.record(i)
    return clock.take(steps)


def test_a_window_close_makes_no_events_and_generations_come_back_once_read() -> None:
    """Events are made at a slot's first use, not ``capacity`` of them at each close: 100
    windows of 3 steps, each read and released, make 3 per generation in use plus the
    boundary that leaves with each window (the old clock: 1,024 per close)."""
    clock, made, device = _clock(1024)
    for _ in range(100):
        w = _window(clock, device, 3)
        assert w is not None
        w[1].release()
    assert len(made) <= 2 * 3 + 100


def test_an_event_the_sender_holds_is_never_rerecorded_and_a_sender_far_behind_gets_host_times() -> None:
    clock, made, device = _clock(4)
    held = [_window(clock, device, 2) for _ in range(GENERATIONS)]
    assert all(w is not None for w in held)
    n = len(made)
    # Every generation is held by a window the sender has not read: the next window is
    # timed on the host clock, and no event is made for it.
    assert _window(clock, device, 2) is None and len(made) == n
    held[0][1].release()  # the sender read the oldest
    assert _window(clock, device, 2) is None  # recorded before the generation came back
    again = _window(clock, device, 2)
    assert again is not None
    prev, events = again
    assert prev is None, "the window before ended on the host clock: no device start"
    # Slot 0 is the oldest window's event, re-recorded only now that it was read; slot 1's
    # left with that window (the start of the window after it) and is new.
    assert events[0] is held[0][1][0] and events[1] not in held[0][1]
    for _, evs in held[1:]:  # the windows still held were never recorded over
        assert all(e.records == 1 for e in evs)


def test_a_window_dropped_unread_gives_its_generation_back() -> None:
    import gc

    clock, _, device = _clock(4)
    held = [_window(clock, device, 2) for _ in range(GENERATIONS)]
    assert _window(clock, device, 2) is None
    del held[0]  # the sender's buffer was full: the oldest window dropped unread
    gc.collect()
    assert _window(clock, device, 2) is None
    assert _window(clock, device, 2) is not None
