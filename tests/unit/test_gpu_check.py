"""``make gpu-check`` (tools/gpu_check.py) without a GPU: its verdicts on recorded and
synthetic numbers, its error handling, and that without CUDA it runs nothing and exits 0.

What the checks exercise on a GPU is unit-tested elsewhere on the CPU: the CUDA-event
clock (test_device_clock.py), the comm hook's device events (test_comm_device.py, with
stand-in events), first-step attribution (test_trace_gpu.py), NVML (test_nvml.py,
against a stand-in library), the callbacks' token counter
(tests/integration/test_callbacks.py)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "gpu_check.py"


@pytest.fixture(scope="module")
def gc() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", TOOL)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


def test_without_cuda_it_says_so_and_runs_nothing() -> None:
    out = subprocess.run([sys.executable, str(TOOL)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines() == [
        "gpu-check: no CUDA device here: nothing checked (run it on a machine with a GPU)"
    ]


def test_step_times_against_the_reference(gc: ModuleType) -> None:
    ref = [0.010, 0.020, 0.030]
    assert gc.compare_step_times([0.0101, 0.0199, 0.0302], ref).status == "PASS"
    bad = gc.compare_step_times([0.010, 0.025, 0.030], ref)
    assert bad.status == "FAIL" and "1 of 3" in bad.detail
    assert gc.compare_step_times([0.01], ref).status == "FAIL"


def test_unsynced_events_must_still_see_the_device(gc: ModuleType) -> None:
    # The H200's figures: back-to-back steps are shorter than synchronised ones.
    ok = gc.compare_unsynced([0.00137, 0.00136], [0.00137, 0.00137], [0.0001, 0.0001], 0.00146)
    assert ok.status == "PASS" and "host ran ahead" in ok.detail
    launch_times = gc.compare_unsynced([0.0001, 0.0001], [0.00137, 0.00137], [0.0001, 0.0001], 0.00146)
    assert launch_times.status == "FAIL" and "2 of 2 steps off" in launch_times.detail
    assert gc.compare_unsynced([0.00137], [0.00137, 0.00137], [0.0001], 0.00146).status == "FAIL"


def test_first_step_verdict(gc: ModuleType) -> None:
    """Figures of HTA's A100 DLRM trace: 371.6 ms first step before the fix, 216.3 after."""
    steady = [0.2156, 0.2165, 0.2162, 0.2125]
    assert gc.first_step_verdict([0.2163, *steady], [0.2163, *steady], 0.155).status == "PASS"
    assert gc.first_step_verdict([0.3716, *steady], [0.2163, *steady], 0.0).status == "FAIL"
    assert gc.first_step_verdict([0.2163, *steady], [0.30, *steady], 0.155).status == "FAIL", (
        "trace vs events"
    )
    # An H200 whose device was idle when the profiler started: the events' first step is
    # longer than the steady ones too; the trace agrees with them.
    h200 = [0.00205, 0.00205, 0.00205, 0.00205]
    assert gc.first_step_verdict([0.00245, *h200], [0.00238, *h200], 0.0).status == "PASS"
    assert gc.first_step_verdict([0.00541, *h200], [0.00238, *h200], 0.0).status == "FAIL"
    assert gc.first_step_verdict([0.00205] * 2, [0.00205] * 2, 0.0).status == "FAIL", "too few steps"


def test_profiler_window_verdict(gc: ModuleType) -> None:
    def entry(first: int, times: list[float], compute: list[float], **kw: Any) -> dict[str, Any]:
        cost = {"on_thread_s": 0.003, "overhead_ratio": 0.02}
        return {
            "first_step": first,
            "device": "cuda",
            "time_s": times,
            "compute_s": compute,
            "cost": cost,
            **kw,
        }

    events = {17: 0.0190, 18: 0.0160, 33: 0.0160, 34: 0.0160}
    two = [entry(17, [0.0161, 0.0160], [0.0158, 0.0158]), entry(33, [0.0160, 0.0161], [0.0158, 0.0158])]
    ok = gc.profiler_window_verdict(two, events, 2)
    assert ok.status == "PASS", ok.detail  # the first step: shorter than its events by the start (3 ms)
    skipped = gc.profiler_window_verdict(
        [{"first_step": 17, "skipped": "another profiler active"}], events, 1
    )
    assert skipped.status == "FAIL" and "another profiler active" in skipped.detail
    one_short = gc.profiler_window_verdict(two[:1], events, 2)
    assert one_short.status == "FAIL" and "1 of 2 windows" in one_short.detail
    lost = gc.profiler_window_verdict([*two, {"first_step": 49, "skipped": "no device activity"}], events, 2)
    assert lost.status == "FAIL" and "1 skipped" in lost.detail
    off = gc.profiler_window_verdict([entry(17, [0.0161, 0.0200], [0.0158, 0.0190])], events, 1)
    assert off.status == "FAIL" and "step 18" in off.detail
    # The H200's later windows before the tail rule: the first step 30 ms, its events 16.
    tail = gc.profiler_window_verdict([entry(33, [0.0300, 0.0160], [0.0160, 0.0158])], events, 1)
    assert tail.status == "FAIL" and "step 33" in tail.detail, "never longer than its events"
    host = gc.profiler_window_verdict(
        [entry(17, [0.0161, 0.0160], [0.0158, 0.0158], device="cpu")], events, 1
    )
    assert host.status == "FAIL" and "'cpu'" in host.detail
    idle = gc.profiler_window_verdict([entry(17, [0.0161, 0.0160], [0.0158, 0.0080])], events, 1)
    assert idle.status == "FAIL" and "under 80% compute" in idle.detail
    unknown = gc.profiler_window_verdict([entry(40, [0.0161, 0.0160], [0.0158, 0.0158])], events, 1)
    assert unknown.status == "FAIL" and "no event time" in unknown.detail


def test_nvml_verdict(gc: ModuleType) -> None:
    good = {
        "gpu_uuid": "GPU-5c0e3c1a-1a2b-4c3d-8e9f-000000000001",
        "sm_clock_mhz": 1980.0,
        "power_w": 412.5,
        "temperature_c": 51.0,
        "throttle_reasons": [],
    }
    assert gc.nvml_verdict(good, "5c0e3c1a-1a2b-4c3d-8e9f-000000000001").status == "PASS"
    other = gc.nvml_verdict(good, "GPU-ffffffff-0000-0000-0000-000000000000")
    assert other.status == "FAIL" and "is not torch's device" in other.detail
    assert gc.nvml_verdict({**good, "power_w": None}, None).status == "FAIL"
    assert gc.nvml_verdict(None, None).status == "FAIL"


def test_tokens_verdict(gc: ModuleType) -> None:
    assert gc.tokens_verdict(0.002, 0.15, 4096, 4096).status == "PASS"
    assert gc.tokens_verdict(0.14, 0.15, 4096, 4096).status == "FAIL", "add() waited for the device"
    assert gc.tokens_verdict(0.002, 0.15, 3000, 4096).status == "FAIL"


def test_ddp_verdicts(gc: ModuleType) -> None:
    sync = {0: [0.055, 0.052, 0.056], 1: [0.004, 0.003, 0.005]}
    assert gc.ddp_lag_verdict(sync, 0.05, True).status == "PASS"
    assert gc.ddp_lag_verdict({0: [0.01], 1: [0.01]}, 0.05, True).status == "FAIL", (
        "no wait for the late rank"
    )
    assert gc.ddp_lag_verdict(sync, 0.05, False).status == "FAIL", "gradients changed"
    assert gc.ddp_lag_verdict({0: [0.05]}, 0.05, True).status == "FAIL"
    assert gc.ddp_single_verdict([0.002] * 5, [0.03] * 5, 18, 18, 40, True).status == "PASS"
    # The H200's figures: the host held to the device's pace by a full launch queue, and
    # the device still behind at every step: no sync.
    assert gc.ddp_single_verdict([0.02506] * 5, [0.02629] * 5, 18, 18, 61, True).status == "PASS"
    synced = gc.ddp_single_verdict([0.002] * 5, [0.03] * 5, 17, 18, 40, True)
    assert synced.status == "FAIL" and "SYNCED" in synced.detail
    assert gc.ddp_single_verdict([0.002] * 5, [0.03] * 5, 0, 0, 40, True).status == "FAIL", "nothing asked"
    assert gc.ddp_single_verdict([0.002] * 5, [0.03] * 5, 18, 18, 0, True).status == "FAIL", "not timed"
    assert gc.ddp_single_verdict([0.002] * 5, [0.03] * 5, 18, 18, 40, False).status == "FAIL"


def _doc(
    clock: str, arrive: list[float | None], end: list[float | None], step: list[float]
) -> dict[str, object]:
    """A version-2 section (integer microseconds; the end is arrival plus sync)."""
    a_us = [None if a is None else round(a * 1e6) for a in arrive]
    sync = [
        None if a is None or e is None else round(e * 1e6) - round(a * 1e6)
        for a, e in zip(arrive, end, strict=True)
    ]
    return {"steps": {"time_s": step}, "comm": {"clock": clock, "arrive_us": a_us, "sync_us": sync}}


def test_a_version_1_section_is_read_as_well(gc: ModuleType) -> None:
    v1 = {"steps": {"time_s": [0.04]}, "comm": {"clock": "device", "arrive_s": [0.031], "end_s": [0.034]}}
    assert gc.ddp_device_verdict([v1]).status == "PASS"
    assert gc.arrival_and_end(_doc("device", [0.031], [0.034], [0.04])["comm"]) == (
        [pytest.approx(0.031)],
        [pytest.approx(0.034)],
    )


def test_ddp_device_verdict(gc: ModuleType) -> None:
    """The sections the hook's CUDA path sends (their making is tested with stand-in
    events in test_comm_device.py): on the device clock, arrival <= end <= step."""
    good = [_doc("device", [None, 0.031, 0.030], [None, 0.034, 0.033], [0.05, 0.040, 0.041])]
    ok = gc.ddp_device_verdict(good)
    assert ok.status == "PASS" and ok.detail.startswith("2 steps on the device clock"), ok.detail
    assert "arrival 30.50 ms <= end 33.50 ms <= step 40.50 ms; 0 with a sync of 0" in ok.detail
    clamped = gc.ddp_device_verdict([_doc("device", [0.031, 0.032], [0.031, 0.034], [0.04, 0.04])])
    assert "1 with a sync of 0" in clamped.detail, "an end before its arrival, clamped by the wire"
    host = gc.ddp_device_verdict([*good, _doc("host", [0.001], [0.002], [0.04])])
    assert host.status == "FAIL" and "device/host clock" in host.detail, "a window fell back to host times"
    late_end = gc.ddp_device_verdict([_doc("device", [0.031], [0.045], [0.040])])
    assert late_end.status == "FAIL" and "1 of 1 steps" in late_end.detail, "end after the step"
    backwards = gc.ddp_device_verdict([_doc("device", [0.035], [0.031], [0.040])])
    assert backwards.status == "FAIL", "arrival after end"
    rounded = gc.ddp_device_verdict([_doc("device", [0.031], [0.031], [0.030999])])
    assert rounded.status == "PASS", "the wire's 1 µs rounding is not a failure"
    assert gc.ddp_device_verdict([]).status == "FAIL"
    assert gc.ddp_device_verdict([_doc("device", [None], [None], [0.04])]).status == "FAIL"


def test_numbers_under_a_key_anywhere(gc: ModuleType) -> None:
    doc = [{"comm": {"steps": [{"sync_s": 0.05, "n": 3}, {"sync_s": 0.04}], "ops": {"x_sync_s": [1, True]}}}]
    assert gc.numbers_under(doc, "sync_s") == [0.05, 0.04, 1.0]
    assert gc.numbers_under(doc, "missing") == []


def test_a_check_that_raises_becomes_a_fail_line(gc: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    def boom() -> list[object]:
        raise RuntimeError("driver gone")

    def fine() -> list[object]:
        return [gc.Verdict("fine", "PASS", "ok")]

    verdicts = gc.run([("boom", boom), ("fine", fine)])
    assert [(v.name, v.status) for v in verdicts] == [("boom", "FAIL"), ("fine", "PASS")]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("FAIL boom: error: RuntimeError: driver gone") and lines[1].startswith(
        "PASS fine: ok"
    )
