"""The profiler window with the real torch.profiler, in one process (no process group).

The sender is replaced by a recorder (the HTTP path is covered in tests/integration and
tests/e2e); the windows it receives are encoded with the agent's own code.
"""

from __future__ import annotations

import json
import math
from array import array
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import stepwatch  # noqa: E402
from stepwatch._clock_sync import ClockSync  # noqa: E402
from stepwatch._env import detect  # noqa: E402
from stepwatch._sender import MemorySink, SenderStats  # noqa: E402
from stepwatch._window import Window  # noqa: E402
from stepwatch.config import AgentConfig  # noqa: E402
from stepwatch.profiler._window import ProfilerWindow  # noqa: E402

PARTS = ("compute_s", "comm_overlapped_s", "comm_exposed_s", "data_wait_s", "idle_s")


class CountingWindow(ProfilerWindow):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.edges: list[int] = []

    def edge(self, step: int, times: array[float], n: int) -> int:
        self.edges.append(step)
        return super().edge(step, times, n)


def _train(sw: stepwatch.Stepwatch, steps: int, pw: ProfilerWindow | None = None) -> None:
    """A few real steps; with ``pw``, each step also waits for the profiler thread to be
    idle (so that no window is skipped for "still being parsed": the loop is ~1 ms a step)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [torch.randn(32, 64) for _ in range(steps)]
    for x in sw.loader(iter(batches)):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sw.step(tokens=32)
        if pw is not None:
            assert pw._idle.wait(30)


def _agent(pw: ProfilerWindow) -> tuple[stepwatch.Stepwatch, MemorySink]:
    rec = MemorySink()
    cfg = AgentConfig(run="r", send_interval_s=1e9, warmup_steps=0)
    sw = stepwatch.Stepwatch(cfg, detect({}, host="h"), convention=None, sender=rec, profiler=pw)
    return sw, rec


def _encoded(sw: stepwatch.Stepwatch, window: Window) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(sw._encode(window, SenderStats()))
    return doc


def test_windows_profile_the_scheduled_steps_and_ride_on_the_next_batch() -> None:
    # A budget no window can exceed, so the period stays 4 although the steps take ~1 ms.
    pw = CountingWindow(
        every=4, steps=2, budget=1e9, warmup_end=0, clock_sync=ClockSync(0, "h", single_host=True)
    )
    sw, rec = _agent(pw)
    _train(sw, 11, pw)
    assert sw.close()
    # Edges only: start at 4, step at 5, stop at 6; start at 8, step at 9, stop at 10.
    assert pw.edges == [4, 5, 6, 8, 9, 10]
    (window,) = rec.windows
    doc = _encoded(sw, window)
    assert doc["schema_version"] == 2
    profiles = doc["profiles"]
    assert [(p["first_step"], p["n_steps"], p["device"]) for p in profiles] == [(5, 2, "cpu"), (9, 2, "cpu")]
    for p in profiles:
        for j in range(2):
            assert math.fsum(p[k][j] for k in PARTS) == pytest.approx(p["time_s"][j], rel=0.02)
            assert p["compute_s"][j] > 0 and p["data_wait_s"][j] > 0  # the loader wrapper's spans
        # The profiler's step spans lie inside the agent's own step intervals (the agent's
        # first profiled step also holds the profiler's start).
        own = window.step_time_s[p["first_step"] - 1 : p["first_step"] + 1]
        assert all(0 < t <= o + 1e-3 for t, o in zip(p["time_s"], own, strict=True)), (p["time_s"], own)
        assert any(o["name"] == "aten::addmm" for o in p["top_ops"])
        cost = p["cost"]
        assert cost["every"] == 4 and cost["window_s"] >= cost["on_thread_s"] > 0 and cost["parse_cpu_s"] > 0
        assert p["clock"] == {"offset_s": 0.0, "uncertainty_s": 0.0, "method": "same-host"}
        assert p["nvml"] is None
    assert _encoded(sw, window)["profiles"] == profiles, "a retry re-sends the same entries"
    stats = sw.stats["profile"]
    assert (stats["windows"], stats["skipped"], stats["dropped"]) == (2, 0, 0)


def test_another_active_profiler_skips_the_window_and_says_so() -> None:
    pw = ProfilerWindow(every=3, steps=1, budget=1e9, warmup_end=0)
    sw, rec = _agent(pw)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        _train(sw, 4)
    assert sw.close()
    (p,) = _encoded(sw, rec.windows[0])["profiles"]
    assert p == {"first_step": 4, "n_steps": 0, "skipped": "another profiler active"}


def test_a_window_is_skipped_while_the_previous_one_is_being_parsed() -> None:
    pw = ProfilerWindow(every=3, steps=1, budget=1e9, warmup_end=0)
    sw, rec = _agent(pw)
    pw._idle.clear()  # as if the profiler thread were still parsing a window
    _train(sw, 4)
    pw._idle.set()
    assert sw.close()
    (p,) = _encoded(sw, rec.windows[0])["profiles"]
    assert p == {"first_step": 4, "n_steps": 0, "skipped": "previous window still being parsed"}


def test_schedule_is_aligned_to_multiples_of_the_period_after_warmup() -> None:
    pw = ProfilerWindow(every=10, steps=2, budget=0.01, warmup_end=25)
    assert [pw.next_start(s) for s in (0, 25, 29, 30, 31)] == [30, 30, 30, 40, 40]
    with pytest.raises(ValueError, match="profile_steps < profile_every"):
        ProfilerWindow(every=2, steps=2, budget=0.01, warmup_end=0)


@pytest.mark.parametrize(
    ("costs", "step_s", "every"),
    [
        ([0.001], 0.1, 10),  # 0.1% of 10 steps: within budget, no stretch
        ([0.5], 0.1, 640),  # needs 500 steps: 10 x 64
        ([0.5, 0.01, 0.02], 0.1, 20),  # the median, so one expensive window does not stretch
        ([1e9], 0.1, 10 * 1024),  # capped
    ],
)
def test_period_stretches_by_powers_of_two_to_meet_the_budget(
    costs: list[float], step_s: float, every: int
) -> None:
    pw = ProfilerWindow(every=10, steps=2, budget=0.01, warmup_end=0)
    pw._costs.clear()  # drop the prior
    pw._costs.extend(costs)
    pw._mult = pw._stretch(step_s)
    assert pw.every == every


def test_the_first_window_already_respects_the_budget_through_the_prior() -> None:
    """Steps of 10 ms: 100 steps are 1 s, and a window (prior 0.1 s) would cost 10%."""
    pw = ProfilerWindow(every=100, steps=2, budget=0.01, warmup_end=0)
    times = array("d", [0.01] * 32)
    assert pw.edge(100, times, 32) == 1600, "stretched to 100 x 2**j >= 0.1 / (1% x 10 ms) = 1000"
    assert pw.every == 1600 and not pw.active
    slow = ProfilerWindow(every=100, steps=2, budget=0.01, warmup_end=0)
    assert slow.edge(100, array("d", [1.0] * 32), 32) == 100 + 1 and slow.active, "1 s steps: no stretch"
    slow.drain(5)


def test_an_internal_error_mid_window_stops_the_profiler() -> None:
    pw = ProfilerWindow(every=3, steps=2, budget=1e9, warmup_end=0)
    sw, _ = _agent(pw)
    _train(sw, 4)  # the window started at the end of step 3
    assert pw.active and torch.autograd.profiler._is_profiler_enabled
    with pytest.warns(RuntimeWarning, match="disabled itself"):
        sw.step(tokens=object())  # type: ignore[arg-type]  # not a count: an internal error
    assert not pw.active and not torch.autograd.profiler._is_profiler_enabled
    sw.close()


def test_a_due_window_waits_for_the_entry_of_its_profiled_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch interval ends at the very step that stops a profiler window: the batch waits
    (the parse is still running), so the entry rides on the batch of the steps it profiled,
    also when that step is the last one of the run."""
    from stepwatch import _agent

    clock = [1000.0]
    monkeypatch.setattr(_agent, "_perf", lambda: clock[0])
    pw = ProfilerWindow(every=2, steps=1, budget=1e9, warmup_end=0)
    rec = MemorySink()
    cfg = AgentConfig(run="r", send_interval_s=1.0, warmup_steps=0)
    sw = stepwatch.Stepwatch(cfg, detect({}, host="h"), convention=None, sender=rec, profiler=pw)
    for _ in range(3):  # the window starts after step 2 and stops at step 3
        clock[0] += 0.4
        sw.step(tokens=1)
    assert not rec.windows, "1.2 s elapsed, but the parse of step 3 is pending: the batch waits"
    assert sw.close()
    assert [w.n_steps for w in rec.windows] == [3]
    (p,) = _encoded(sw, rec.windows[0])["profiles"]
    assert (p["first_step"], p["n_steps"]) == (3, 1)


def test_each_batch_says_through_which_step_its_profiles_are_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    """A window's entry is built on the profiler thread and often rides on a later batch
    than its steps; each batch says through which step every window's entry has been sent
    (``steps.profiles_through``), for the collector to compare a window's ranks only once
    their profiles are in. An entry whose steps are in no batch yet waits for them."""
    import threading
    import time

    pw = ProfilerWindow(every=4, steps=2, budget=1e9, warmup_end=0)
    parsing = threading.Event()
    parse = pw.process
    monkeypatch.setattr(pw, "process", lambda job: parsing.wait(30) and parse(job))
    sw, rec = _agent(pw)

    def due() -> dict[str, Any]:
        sw._close_window(time.perf_counter())  # the send interval ends here
        doc = _encoded(sw, rec.windows[-1])
        return {**doc["steps"], "profiles": doc.get("profiles", [])}

    _train(sw, 5)  # the window of steps 5-6 records
    first = due()
    assert (first["first"], len(first["time_s"]), first["profiles_through"]) == (1, 5, 4)
    assert first["profiles"] == []
    _train(sw, 3)  # it stops at 6 and its parse waits; step 8 finds it busy and skips 9-10
    second = due()
    assert (second["first"], second["profiles_through"], second["profiles"]) == (6, 4, [])
    parsing.set()
    assert pw._idle.wait(30)
    _train(sw, 1)
    third = due()
    assert third["profiles_through"] == 9
    assert [(e["first_step"], e["n_steps"], e.get("skipped")) for e in third["profiles"]] == [
        (5, 2, None),
        (9, 0, "previous window still being parsed"),
    ]
    again = _encoded(sw, rec.windows[-1])
    assert (again["steps"]["profiles_through"], len(again["profiles"])) == (9, 2), "a retry sends the same"
    assert sw.close()
    final = _encoded(sw, rec.windows[-1])
    assert final["final"] and final["steps"]["profiles_through"] == 9 and "profiles" not in final


def test_an_entry_waits_for_the_batch_with_its_last_step_and_a_stuck_one_is_given_up() -> None:
    from stepwatch.profiler import _window as window_module

    pw = ProfilerWindow(every=4, steps=2, budget=1e9, warmup_end=0)
    for first, n in ((13, 2), (9, 0), (5, 2)):  # as pushed: a skip goes ahead of a parse
        pw.results.append({"first_step": first, "n_steps": n})
    entries, through = pw.take_through(13)  # step 14 is in no batch yet: 13-14 waits
    assert [e["first_step"] for e in entries] == [5, 9] and through == 12
    entries, through = pw.take_through(14)
    assert [e["first_step"] for e in entries] == [13] and through == 14
    pw.owed_from, pw._owed_stopped = 17, window_module._perf()  # being parsed
    assert pw.take_through(20) == ([], 16)
    pw._owed_stopped -= window_module.OWED_GIVE_UP_S + 1  # a parse stuck for over a minute
    assert pw.take_through(20) == ([], 20), "a stuck parse no longer holds the analysis back"
    pw._owed_stopped = 0.0  # still recording (it stops at its last step): owed, however long
    assert pw.take_through(20) == ([], 16)


# -- lasting overhead, CUPTI release, trace cap ---------------------------------------


class _ExportingProfiler:
    """Stands in for torch.profiler.profile (start/step/stop are what the window calls) and
    exports a synthetic CUDA trace (tests/kineto.py): no GPU here."""

    step_num = 0

    def __init__(self, trace: dict[str, Any]) -> None:
        self.trace = trace

    def start(self) -> None: ...

    def step(self) -> None: ...

    def stop(self) -> None: ...

    def export_chrome_trace(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.trace, fh)


def _window_at(pw: ProfilerWindow, start: int, step_s: float) -> dict[str, Any]:
    times = array("d", [step_s] * 32)
    assert pw.edge(start, times, 32) == start + 1 and pw.active
    pw.edge(start + 1, times, 32)
    pw.edge(start + 2, times, 32)
    assert not pw.active and pw._idle.wait(30)
    (entry,) = pw.take()
    return entry


def _fake_window(trace: dict[str, Any] | None = None, **kw: Any) -> ProfilerWindow:
    """A CUDA rank's window (``cuda=False``: a CPU rank's) exporting ``trace`` (default: a
    synthetic CUDA training trace of steps 11 and 12)."""
    from ..kineto import training_trace

    exported = trace if trace is not None else training_trace(steps=2, first_step=11).to_dict()
    return ProfilerWindow(
        every=10,
        steps=2,
        warmup_end=0,
        make_profiler=lambda: _ExportingProfiler(exported),
        other_profiler_active=lambda: False,
        **{"budget": 1e9, "cuda": True, **kw},
    )


def test_a_lasting_slowdown_after_a_window_is_counted_against_the_budget() -> None:
    """Steps before the first window take 100 ms; before the second, 115 ms: CUPTI stayed
    attached. The 15 ms is paid by the 8 unprofiled steps of the period."""
    pw = _fake_window()
    first = _window_at(pw, 10, 0.100)
    assert pw.before_first_s == pytest.approx(0.100)
    assert first["cost"]["lasting_s"] == 0.0 and first["cost"]["lasting_ratio"] is None
    assert first["n_steps"] == 2 and first["copy_s"], "the synthetic CUDA trace parsed"
    second = _window_at(pw, 20, 0.115)
    cost = second["cost"]
    assert cost["lasting_ratio"] == pytest.approx(0.15)
    assert cost["lasting_s"] == pytest.approx(0.015 * 8)
    assert cost["window_s"] >= cost["lasting_s"] + cost["on_thread_s"]
    third = _window_at(pw, 30, 0.102)  # 2%: noise, not a lasting slowdown
    assert third["cost"]["lasting_s"] == 0.0 and third["cost"]["lasting_ratio"] == pytest.approx(0.02)


def test_a_cpu_rank_does_not_take_its_drift_for_a_lasting_slowdown() -> None:
    """No CUPTI on a CPU rank: steps 15% slower before its second window are the host's
    drift (the overhead benchmark's VM drifts more than 3% within minutes), not a cost of
    the window to charge to every step of the period and stretch it by."""
    pw = _fake_window(cuda=False, budget=0.01)
    pw._costs.clear()
    pw._checked_prior = True
    _window_at(pw, 10, 0.100)
    pw._mult = 1
    second = _window_at(pw, 20, 0.115)
    assert second["cost"]["lasting_s"] == 0.0 and second["cost"]["lasting_ratio"] is None
    cost = second["cost"]
    assert cost["window_s"] == pytest.approx(cost["on_thread_s"] + cost["slowdown_s"] + cost["parse_cpu_s"])


def test_the_lasting_cost_stretches_the_period() -> None:
    pw = _fake_window(budget=0.01)
    pw._costs.clear()  # no prior: only measured costs count
    pw._checked_prior = True
    _window_at(pw, 10, 0.100)
    pw._mult = 1  # whatever the first window's own (tiny, load-dependent) cost did
    pw._costs.clear()
    _window_at(pw, 20, 0.130)  # 30% slower for good: 0.24 s per period of 1.3 s
    assert pw.last_cost is not None and pw.last_cost["lasting_s"] == pytest.approx(0.24)
    assert pw.every >= 10 * 16, "0.24 s within 1% of the period needs 185 steps or more"


def test_a_trace_over_the_cap_is_skipped_and_says_why() -> None:
    pw = _fake_window(max_trace_bytes=1_000)
    entry = _window_at(pw, 10, 0.1)
    assert entry["n_steps"] == 0 and "cap" in entry["skipped"]
    assert entry["cost"]["window_s"] > 0, "its export still counts"


def test_a_cuda_window_whose_trace_holds_no_device_work_is_skipped_not_read_as_cpu() -> None:
    """An H200 (torch 2.11, CUDA 13.0, TEARDOWN_CUPTI=1) gave a window started right after
    another torch.profiler session a trace without one kernel; parsed as is, the window
    read as a CPU rank's (2% compute)."""
    from stepwatch.profiler._window import NO_DEVICE_ACTIVITY

    from ..kineto import KinetoTrace

    t = KinetoTrace()
    for i, n in enumerate((11, 12)):
        t.step(n, i * 1000.0, 1000.0)
        t.host("aten::mm", i * 1000.0 + 10.0, 50.0)
    trace = t.to_dict()
    entry = _window_at(_fake_window(trace), 10, 0.1)
    assert entry["n_steps"] == 0 and entry["skipped"] == NO_DEVICE_ACTIVITY
    assert entry["cost"]["window_s"] > 0, "its cost counts, as a window's"
    cpu = _window_at(_fake_window(trace, cuda=False), 10, 0.1)
    assert cpu["device"] == "cpu" and cpu["n_steps"] == 2, "a CPU rank's window is its host ops"


@pytest.mark.parametrize(
    ("env", "cuda", "on", "after"),
    [
        ({}, "12.6", True, "1"),
        ({}, "13.0", True, "1"),
        ({}, "12.4", False, None),  # teardown crashes with CUDA graphs before 12.6
        ({}, None, False, None),  # CPU build
        ({"TEARDOWN_CUPTI": "0"}, "12.8", False, "0"),  # set by the user or by torch: kept
        ({"TEARDOWN_CUPTI": "1"}, "11.8", True, "1"),
    ],
)
def test_cupti_is_released_after_windows_where_torch_allows_it(
    env: dict[str, str], cuda: str | None, on: bool, after: str | None
) -> None:
    from stepwatch.profiler._window import release_cupti_after_windows

    assert release_cupti_after_windows(env, cuda) is on
    assert env.get("TEARDOWN_CUPTI") == after
