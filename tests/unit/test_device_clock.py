"""The CUDA-event clock's logic, driven by stand-in events.

There is no GPU on the machines this suite runs on, so ``torch.cuda.Event`` cannot be
created here; ``FakeEvent`` implements the three methods the clock uses, with a device
timestamp and a completion flag the test controls. This stands in for the GPU only.
"""

from __future__ import annotations

import pytest

from stepwatch._device_clock import CudaEventClock


class FakeEvent:
    def __init__(self, device: list[float]) -> None:
        self._device = device  # shared "device clock" in ms, advanced by the test
        self.t: float | None = None
        self.done = False
        self.records = 0

    def record(self) -> None:
        self.t = self._device[0]
        self.records += 1

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end_event: FakeEvent) -> float:
        assert self.done and end_event.done, "elapsed_time on an incomplete event would block"
        assert self.t is not None and end_event.t is not None
        return end_event.t - self.t


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
