"""The CUDA-event clock's logic, driven by stand-in events.

There is no GPU on the machines this suite runs on, so ``torch.cuda.Event`` cannot be
created here; ``tests/fake_cuda.FakeEvent`` stands in for it (here created incomplete,
as a just-recorded event is). This stands in for the GPU only.
"""

from __future__ import annotations

import pytest

from stepwatch._device_clock import CudaEventClock

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
