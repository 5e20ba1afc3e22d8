"""The communication hook's device clock (``_comm_device``), driven by stand-in events.

There is no GPU on the machines this suite runs on, so ``torch.cuda.Event`` cannot be
created here: ``tests/fake_cuda.FakeEvent`` stands in for it. What the real events do on
a GPU is checked by ``make gpu-check`` (its ``ddp_device`` line).
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import pytest
import torch

from stepwatch import _comm_device
from stepwatch._comm_timing import CommTiming, TimingSlices, comm_hook
from stepwatch._device_clock import CudaEventClock, DeviceEvent

from ..fake_cuda import FakeEvent


class Rank:
    """One rank's agent side: the hook's timing and the step clock, on one fake device.

    Per step (device ms): the step starts at ``t0``; bucket ``b`` arrives at
    ``t0 + arrive[b]`` and its all-reduce ends at ``t0 + end[b]``; the step ends at
    ``t0 + step``. The host records at once (it only launches), so its times are far off.
    """

    def __init__(self, cap: int = 8) -> None:
        self.device = [0.0]
        self.made: list[FakeEvent] = []
        self.pos = [1, 0]
        self.timing = CommTiming(cap, lambda: (self.pos[0], self.pos[1]))
        self.timing.start_device(self.make)
        self.clock = CudaEventClock(cap, self.make)
        self.host_times: list[float] = []
        self._last = time.perf_counter()

    def make(self) -> DeviceEvent:
        self.made.append(FakeEvent(self.device))
        return self.made[-1]

    def step(self, arrive: list[float], end: list[float], step: float) -> None:
        t0 = self.device[0]
        for b, (a, e) in enumerate(zip(arrive, end, strict=True)):
            token = self.timing.arrive("world", b, 4096)
            assert token is not None
            self.device[0] = t0 + a
            end = self.timing.device_arrival(token[1])
            self.device[0] = t0 + e
            if end is not None:  # None: no generation free, this window is on the host clock
                end[0].record()  # the then() callback
            self.timing.done(token, "world")
        self.device[0] = t0 + step
        self.clock.record(self.pos[1])
        now = time.perf_counter()
        self.host_times.append(now - self._last)
        self._last = now
        self.pos[1] += 1

    def close(self) -> tuple[TimingSlices, Any, float]:
        n = self.pos[1]
        slices = self.timing.take(n)
        assert slices is not None
        dev = self.clock.take(n)  # None: no generation was free, host times
        perf_end = self._last
        self.pos = [self.pos[0] + n, 0]
        return slices, dev, perf_end

    def encode(self, first: int, slices: TimingSlices, dev: Any, perf_end: float) -> dict[str, Any]:
        """What the agent's sender does: step clock first (its deadline), then the comm section."""
        n = len(slices.step_of)  # the window's steps
        host = self.host_times[-n:] if n else []
        steps = None
        if dev is not None:
            prev, events = dev
            times, on_device = CudaEventClock.resolve_all(prev, events, host, deadline_s=0.0)
            steps = (prev, events, times) if on_device else None
        out = self.timing.summarise(slices, first, host, perf_end, device_steps=steps)
        if dev is not None:
            dev[1].release()  # as the sender does once it has read the window
        return out


def test_offsets_come_from_the_device_events_relative_to_the_step_start() -> None:
    r = Rank()
    r.step([10.0, 30.0], [40.0, 55.0], 100.0)  # window 1: step 1 has no device start
    slices1, dev1, end1 = r.close()
    r.encode(1, slices1, dev1, end1)
    r.step([10.0, 30.0], [40.0, 55.0], 100.0)  # steps 2, 3: the second arrives late
    r.step([20.0, 80.0], [90.0, 95.0], 120.0)
    slices, dev, perf_end = r.close()
    out = r.encode(2, slices, dev, perf_end)
    assert out["clock"] == "device"
    assert out["version"] == 2  # integer microseconds
    assert out["arrive_us"] == [30_000, 80_000]  # last bucket ready
    assert out["sync_us"] == [25_000, 15_000]  # end - arrival, last bucket
    assert "end_s" not in out and "arrive_s" not in out
    (ar,) = out["collectives"]
    assert (ar["op"], ar["count"], ar["bytes"]) == ("all_reduce", 4, 4 * 4096)
    # arrival <= end <= step on the device, whatever the host's launch times were.
    times = CudaEventClock.resolve(dev[0], dev[1], [9.0, 9.0], deadline_s=0.0)
    assert times == pytest.approx([0.100, 0.120])
    for a, y, t in zip(out["arrive_us"], out["sync_us"], times, strict=True):
        assert a <= a + y <= t * 1e6  # the end: arrival plus sync


def test_the_runs_first_step_has_no_device_start_and_stays_untimed() -> None:
    r = Rank()
    r.step([10.0], [20.0], 50.0)
    r.step([10.0], [25.0], 50.0)
    slices, dev, perf_end = r.close()
    out = r.encode(1, slices, dev, perf_end)
    assert out["clock"] == "device"
    assert out["arrive_us"] == [None, 10_000]
    assert out["sync_us"] == [None, 15_000]
    assert out["collectives"][0]["count"] == 1


@pytest.mark.parametrize("stuck", ["bucket_end", "step_boundary"])
def test_an_incomplete_event_keeps_the_whole_window_on_host_times(stuck: str) -> None:
    """A stuck device: the last step's second all-reduce (or its step boundary) never
    completes. The comm section waits for nothing (``query()`` only; the step clock's own
    deadline is 0 here) and ships the host section, exactly as without device events,
    labelled ``host``: one window never mixes device offsets with launch times."""
    r = Rank()
    r.step([10.0], [20.0], 50.0)
    r.close()
    for _ in range(3):
        r.step([10.0, 20.0], [30.0, 40.0], 50.0)
    slices, dev, perf_end = r.close()
    assert slices.device is not None
    cap = slices.device.capacity
    event = slices.device.generation.end[1 * cap + 2] if stuck == "bucket_end" else dev[1][2]
    event.done = False  # type: ignore[attr-defined]
    s = slices
    host_only = TimingSlices(s.step_of, s.n_buckets, s.bytes, s.cpu, s.arrive, s.end)
    want = CommTiming(8, lambda: (0, 0)).summarise(host_only, 2, r.host_times[-3:], perf_end)
    out = r.encode(2, slices, dev, perf_end)
    assert out["clock"] == "host" and want["clock"] == "host"
    keys = ("arrive_us", "sync_us", "cpu_us", "collectives")
    assert {k: out[k] for k in keys} == {k: want[k] for k in keys}
    # The window's events were given back all the same, and once the device has caught
    # up the next window is on the device clock again.
    r.step([10.0], [20.0], 50.0)
    s2, d2, e2 = r.close()
    event.done = True  # type: ignore[attr-defined]
    assert r.encode(5, s2, d2, e2)["clock"] == "device"


def test_without_device_step_boundaries_the_section_stays_host() -> None:
    r = Rank()
    r.step([10.0], [20.0], 50.0)
    slices, _dev, perf_end = r.close()
    out = r.timing.summarise(slices, 1, r.host_times, perf_end)
    assert out["clock"] == "host"


def _events(slots: TimingSlices) -> list[Any]:
    assert slots.device is not None
    g = slots.device.generation
    return [e for e in g.arrive + g.end if e is not None]


def test_events_are_made_once_per_used_slot_and_never_rerecorded_while_the_sender_holds_them() -> None:
    r = Rank(cap=4)
    assert r.made == [], "a generation costs no event until a slot is used"
    r.step([1.0], [2.0], 5.0)
    assert len(r.made) == 2 + 1, "the slot's arrival and end, and the step clock's boundary"
    s1, d1, e1 = r.close()  # window 1 goes to the sender
    held = {id(e): e.records for e in _events(s1)}
    r.step([1.0], [2.0], 5.0)  # window 2 records into another generation
    assert {id(e): e.records for e in _events(s1)} == held
    r.encode(1, s1, d1, e1)  # read: window 1's generation is free again
    s2, d2, e2 = r.close()
    r.step([1.0], [2.0], 5.0)  # window 3: the third generation
    third = r.close()  # queued, unread: holds the third generation
    assert third[0].device is not None
    r.encode(2, s2, d2, e2)
    made = len(r.made)
    r.step([1.0], [2.0], 5.0)  # window 4: window 1's generations again
    # No event made but the step clock's boundary: window 1's end left with it, as window 2's start.
    assert len(r.made) == made + 1
    assert all(e.records == 2 for e in _events(s1))
    assert _events(s1) == _events(r.close()[0])


def test_a_sender_far_behind_leaves_the_next_window_on_the_host_clock_until_one_comes_back() -> None:
    """Three windows queued unread hold every generation: the fourth records no device
    event and ships host times; a window dropped unread gives its generation back to the
    window that starts after."""
    import gc

    r = Rank(cap=4)
    queued = []
    for _ in range(3):
        r.step([1.0], [2.0], 5.0)
        queued.append(r.close())
    made = len(r.made)
    r.step([1.0], [2.0], 5.0)
    fourth = r.close()
    assert fourth[0].device is None and fourth[1] is None and len(r.made) == made  # nor the step clock's
    assert r.encode(13, *fourth)["clock"] == "host"
    del queued[0]  # the sender dropped the oldest window (its buffer was full)
    gc.collect()
    r.step([1.0], [2.0], 5.0)
    fifth = r.close()
    assert fifth[0].device is None and fifth[1] is None  # recorded before the generations came back
    r.step([1.0], [2.0], 5.0)
    sixth = r.close()
    assert sixth[0].device is not None and sixth[1] is not None  # the window after: on the device again
    assert sixth[1][0] is None, "its first step has no device start: the window before ended on the host"


def test_a_failed_end_record_leaves_the_window_on_host_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slot's events are reused across windows: an end event whose record failed still
    holds the previous window's time, which must not be read as this one's."""
    device = [0.0]
    failing = [False]

    class Flaky(FakeEvent):
        def record(self) -> None:
            if failing[0] and self in ends:
                raise RuntimeError("CUDA error")
            super().record()

    ends: list[FakeEvent] = []
    made: list[FakeEvent] = []

    def make() -> FakeEvent:
        made.append(Flaky(device))
        if len(made) % 2 == 0:  # the slots' events come in (arrival, end) pairs
            ends.append(made[-1])
        return made[-1]

    monkeypatch.setattr(_comm_device, "cuda_event_factory", lambda: make)
    pos = [1, 0]
    timing = CommTiming(4, lambda: (pos[0], pos[1]))
    hook = comm_hook(_inner, timing=timing)
    clock = CudaEventClock(4, lambda: FakeEvent(device))
    for window in range(4):
        failing[0] = window == 3  # the fourth window reuses the first one's generation
        for i in range(2):
            pos[1] = i
            device[0] = 1000.0 * window + 100.0 * i + 10.0
            hook(None, FakeBucket(0, True)).wait()
            device[0] += 50.0
            clock.record(i)
        slices = timing.take(2)
        assert slices is not None
        prev_ev, events = clock.take(2)
        times, on_device = CudaEventClock.resolve_all(prev_ev, events, [0.1, 0.1], deadline_s=0.0)
        assert on_device, "the step boundaries completed: only the slot's own record failed"
        out = timing.summarise(
            slices, pos[0], [0.1, 0.1], time.perf_counter(), device_steps=(prev_ev, events, times)
        )
        assert out["clock"] == ("host" if window == 3 else "device"), window
        pos[0] += 2


class FakeBuffer:
    def __init__(self, is_cuda: bool) -> None:
        self.is_cuda = is_cuda

    def numel(self) -> int:
        return 1024

    def element_size(self) -> int:
        return 4


class FakeBucket:
    def __init__(self, index: int, is_cuda: bool) -> None:
        self._i, self._buf = index, FakeBuffer(is_cuda)

    def buffer(self) -> FakeBuffer:
        return self._buf

    def index(self) -> int:
        return self._i


def _inner(_state: object, bucket: FakeBucket) -> torch.futures.Future[Any]:
    fut: torch.futures.Future[Any] = torch.futures.Future()
    fut.set_result(bucket.index())
    return fut


@pytest.mark.parametrize("on_cuda", [True, False])
def test_the_hook_records_arrival_and_then_end_and_decides_its_clock_once(
    on_cuda: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    device = [0.0]
    made: list[FakeEvent] = []
    factories = [0]

    def factory() -> Any:
        factories[0] += 1

        def make() -> FakeEvent:
            made.append(FakeEvent(device))
            return made[-1]

        return make

    monkeypatch.setattr(_comm_device, "cuda_event_factory", factory)
    pos = [1, 0]
    timing = CommTiming(4, lambda: (pos[0], pos[1]))
    hook = comm_hook(_inner, timing=timing)
    for step in range(2):
        pos[1] = step
        for b in range(3):
            device[0] = 100.0 * step + 10.0 * b
            fut = hook(None, FakeBucket(b, on_cuda))
            assert fut.wait() == b  # the inner hook's value, unchanged
    assert factories[0] == (1 if on_cuda else 0), "the clock is decided once, at the first bucket"
    assert timing.on_device is on_cuda
    recorded = [e for e in made if e.records]
    # Per bucket one arrival and one end event (the fake future completes at once, so
    # the then() callback ran inline, at the same device time).
    assert len(recorded) == (2 * 3 * 2 if on_cuda else 0)
    slices = timing.take(2)
    assert slices is not None and (slices.device is not None) is on_cuda


def test_the_agent_ships_a_device_section_that_the_collector_accepts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the agent's own window close and sender-side encoding: the hook on a CUDA
    bucket, ``sw.step()`` recording the step boundaries, ``_encode`` resolving the step
    clock and then the hook's events; the collector's schema takes ``"clock": "device"``."""
    import json

    from stepwatch._agent import Stepwatch
    from stepwatch._env import detect
    from stepwatch._sender import MemorySink
    from stepwatch.config import AgentConfig
    from stepwatch_server.schemas.ingest import IngestPayload

    device = [0.0]

    def make() -> FakeEvent:
        return FakeEvent(device)

    monkeypatch.setattr(_comm_device, "cuda_event_factory", lambda: make)
    rec = MemorySink()
    cfg = AgentConfig(run="r", max_window_steps=8, send_interval_s=1e9, warmup_steps=0)
    sw = Stepwatch(
        cfg, detect({}, host="h"), convention=None, sender=rec, device_clock=CudaEventClock(8, make)
    )
    hook = comm_hook(_inner, timing=sw.comm_timing)
    for step in range(4):
        t0 = 100.0 * step
        for b in range(2):
            device[0] = t0 + 20.0 + 30.0 * b  # bucket b ready; then() runs at once (fake future)
            hook(None, FakeBucket(b, True)).wait()
        device[0] = t0 + 100.0
        sw.step(tokens=16)
    sw.flush(1.0)
    (w,) = rec.windows
    doc = json.loads(sw._encode(w, rec.stats))
    comm = doc["comm"]
    assert (doc["agent"]["clock"], comm["clock"]) == ("cuda_events", "device")
    assert doc["steps"]["time_s"][1:] == pytest.approx([0.1, 0.1, 0.1])
    assert comm["arrive_us"] == [None, *[50_000] * 3]  # the run's first step: no start
    assert comm["sync_us"] == [None, 0, 0, 0]  # the fake future ends where it arrives
    IngestPayload.model_validate(doc)
    doc["comm"]["clock"] = "cuda_events"  # the step clock's name is not a comm clock
    with pytest.raises(ValueError, match="clock"):
        IngestPayload.model_validate(doc)


class FakeParam:
    is_cuda = True
    requires_grad = True

    def __init__(self) -> None:
        self.hooks: list[Any] = []

    def numel(self) -> int:
        return 1024

    def element_size(self) -> int:
        return 4

    def register_post_accumulate_grad_hook(self, hook: Any) -> None:
        self.hooks.append(hook)


class FakeDDP:
    """What ``watch`` touches of a DDP model on CUDA (no GPU here, so no real one)."""

    require_backward_grad_sync = True

    def __init__(self) -> None:
        self.hooks: list[Any] = []
        self._module_parameters = [FakeParam()]

    def parameters(self) -> Any:
        return iter(self._module_parameters)

    def register_comm_hook(self, state: object, hook: Any) -> None:
        self.hooks.append(hook)


def test_watching_a_cuda_model_before_the_first_step_starts_the_device_step_clock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``init()`` without a model (CUDA not initialised yet) has no device step clock; the
    hook's device offsets need its boundaries, so ``watch`` starts one, but only before
    the first step: started later, a window's first steps would have no boundary events."""
    from stepwatch import _device_clock
    from stepwatch._agent import Stepwatch
    from stepwatch._env import detect
    from stepwatch._sender import MemorySink
    from stepwatch.config import AgentConfig

    device = [0.0]
    monkeypatch.setattr(
        _device_clock, "cuda_clock", lambda cap: CudaEventClock(cap, lambda: FakeEvent(device))
    )
    cfg = AgentConfig(run="r", max_window_steps=8, send_interval_s=1e9, warmup_steps=0)

    def agent() -> Stepwatch:
        return Stepwatch(cfg, detect({}, host="h"), convention=None, sender=MemorySink())

    fresh = agent()
    model = FakeDDP()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # installed without a complaint
        fresh.watch(model)
    assert fresh._dev is not None
    assert len(model._module_parameters[0].hooks) == 1 and not model.hooks, (
        "the per-step timing (the default)"
    )
    bucketed = FakeDDP()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        agent().watch(bucketed, per_bucket=True)
    assert len(bucketed.hooks) == 1, "the per-bucket comm hook"
    late = agent()
    late.step(tokens=1)
    late.watch(FakeDDP())
    assert late._dev is None, "watched after a step: the hook keeps host times"


def test_a_window_timed_on_the_host_says_so_and_a_retry_keeps_the_clock() -> None:
    """Three windows the sender has not read hold every generation of the step clock: the
    fourth is timed on the host, and its batch says ``host`` (its times measure the launch
    loop on a GPU); the others say ``cuda_events``, and so does a retry of a sent one."""
    import json

    from stepwatch._agent import Stepwatch
    from stepwatch._env import detect
    from stepwatch._sender import MemorySink
    from stepwatch.config import AgentConfig

    device = [0.0]
    rec = MemorySink()  # keeps every window unread until the test encodes it
    cfg = AgentConfig(run="r", max_window_steps=2, send_interval_s=1e9, warmup_steps=0)
    clock = CudaEventClock(2, lambda: FakeEvent(device))
    sw = Stepwatch(cfg, detect({}, host="h"), convention=None, sender=rec, device_clock=clock)
    for _ in range(8):
        device[0] += 100.0
        sw.step(tokens=16)
    assert len(rec.windows) == 4
    clocks = [json.loads(sw._encode(w, rec.stats))["agent"]["clock"] for w in rec.windows]
    assert clocks == ["cuda_events", "cuda_events", "cuda_events", "host"]
    assert json.loads(sw._encode(rec.windows[0], rec.stats))["agent"]["clock"] == "cuda_events"
    assert rec.windows[1].step_time_s[0] == pytest.approx(0.1), "device times, from the window before"
