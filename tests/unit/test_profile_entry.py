"""A profiler trace -> the payload's profile entry (breakdown, collectives, arrivals, top ops)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from stepwatch.profiler._entry import build_entry, top_ops
from stepwatch.profiler.chrome import events_from_chrome_trace, load_chrome_trace
from stepwatch.sketch import LogSketch

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
PARTS = ("compute_s", "copy_s", "comm_overlapped_s", "comm_exposed_s", "data_wait_s", "idle_s")


def _x(name: str, ts: float, dur: float, cat: str = "cpu_op", tid: int = 1, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _sums_hold(entry: dict[str, Any]) -> None:
    for j, t in enumerate(entry["time_s"]):
        parts = math.fsum(entry[p][j] for p in PARTS)
        assert parts == pytest.approx(t, rel=0.02), "the six parts sum to the step time (within 2%)"


def test_cpu_gloo_fixture() -> None:
    """Rank 0 of 2-rank gloo DDP (torch 2.13, recorded with shapes by make_cpu_trace.py)."""
    trace = load_chrome_trace(FIXTURES / "cpu_gloo_ddp_rank0.json")
    e = build_entry(trace, first_step=2, n_steps=2)
    assert (e["first_step"], e["n_steps"], e["device"]) == (2, 2, "cpu")
    _sums_hold(e)
    # t0 is the Unix time of the first step: baseTimeNanoseconds + ts (2026-11-29 here).
    assert 1.79e9 < e["t0"] < 1.80e9
    (coll,) = e["collectives"]
    assert (coll["op"], coll["count"], coll["bytes"]) == ("all_reduce", 2, 2 * 33_088 * 4)
    sk = LogSketch.from_dict(coll["duration"])
    assert sk.count == 2 and 0 < sk.min <= sk.max < max(e["time_s"])
    (g,) = e["arrivals"]
    assert (g["group"], g["ranks"], g["size"], g["key_kind"]) == ("0", [0, 1], 2, "order")
    assert g["step"] == [2, 3] and g["key"] == [0, 0] and g["op"] == ["all_reduce", "all_reduce"]
    for enter, end in zip(g["enter"], g["end"], strict=True):
        assert 0 <= enter < end < sum(e["time_s"]) + 1e-6
    durations = sorted(end - enter for enter, end in zip(g["enter"], g["end"], strict=True))
    assert durations == pytest.approx([sk.min, sk.max], abs=1e-6)
    ops = e["top_ops"]
    assert 0 < len(ops) <= 10
    assert [o["self_s"] for o in ops] == sorted((o["self_s"] for o in ops), reverse=True)
    assert math.fsum(o["self_s"] for o in ops) <= max(e["time_s"])


def test_cuda_fixture_uses_the_device_timeline_and_nccl_sequence_numbers() -> None:
    """The synthetic Kineto GPU trace (make_gpu_trace.py: CUDA DDP rank 0 of 2, H100 layout);
    its hand-computed breakdown is in test_trace.py."""
    e = build_entry(load_chrome_trace(FIXTURES / "cuda_ddp_synthetic_rank0.json"), first_step=4, n_steps=2)
    assert (e["first_step"], e["n_steps"], e["device"]) == (4, 2, "cuda")
    assert e["time_s"] == pytest.approx([1050e-6, 950e-6])
    assert e["compute_s"] == pytest.approx([540e-6, 350e-6])
    assert e["copy_s"] == pytest.approx([20e-6, 20e-6])  # the memcpy, beside no kernel
    assert e["comm_exposed_s"] == pytest.approx([200e-6, 200e-6])
    _sums_hold(e)
    (coll,) = e["collectives"]
    assert (coll["op"], coll["count"], coll["bytes"]) == ("all_reduce", 2, 2 * 2 * 1_048_576)
    (g,) = e["arrivals"]
    assert (g["key_kind"], g["key"], g["step"]) == ("seq", [17, 18], [4, 5])
    # Kernel start/end on the device timeline, relative to the first device step (T0).
    assert g["enter"] == pytest.approx([600e-6, 1650e-6]) and g["end"] == pytest.approx([900e-6, 1900e-6])
    names = [o["name"] for o in e["top_ops"]]
    assert names[0].startswith("ncclDevKernel_AllReduce") and all(len(n) <= 96 for n in names)


def test_steps_are_chosen_by_number_and_a_trace_without_them_is_an_error() -> None:
    trace = {
        "traceEvents": [
            _x("ProfilerStep#7", 0, 100, cat="user_annotation"),
            _x("ProfilerStep#8", 100, 50, cat="user_annotation"),
            _x("aten::mm", 10, 30),
        ]
    }
    e = build_entry(trace, first_step=8, n_steps=1)
    assert (e["first_step"], e["n_steps"], e["time_s"]) == (8, 1, [pytest.approx(50e-6)])
    with pytest.raises(ValueError, match="no ProfilerStep"):
        build_entry({"traceEvents": [_x("aten::mm", 0, 1)]}, first_step=1, n_steps=2)


def test_order_keys_restart_every_step_and_groups_are_separate() -> None:
    info = {"pg_config": [{"pg_name": "0", "pg_size": 2, "ranks": [0, 1]}]}
    trace = {
        "traceEvents": [
            _x("ProfilerStep#1", 0, 100, cat="user_annotation"),
            _x("ProfilerStep#2", 100, 100, cat="user_annotation"),
            *[_x("gloo:all_reduce", t, 5, cat="user_annotation", tid=2) for t in (10, 30, 110, 130, 150)],
        ],
        "distributedInfo": info,
    }
    (g,) = build_entry(trace, first_step=1, n_steps=2)["arrivals"]
    assert g["step"] == [1, 1, 2, 2, 2] and g["key"] == [0, 1, 0, 1, 2]


def test_self_time_subtracts_nested_ops() -> None:
    events = events_from_chrome_trace(
        {
            "traceEvents": [
                _x("ProfilerStep#1", 0, 100, cat="user_annotation"),
                _x("aten::linear", 10, 50),
                _x("aten::addmm", 15, 40),
                _x("aten::copy_", 20, 10),
                _x("aten::relu", 70, 5),
                _x("aten::mm", 80, 5, tid=9),  # another thread: not the training thread
            ]
        }
    )
    ops = {o["name"]: o["self_s"] for o in top_ops(events, (0, 100), "cpu", 1)}
    assert ops == pytest.approx(
        {"aten::addmm": 30e-6, "aten::linear": 10e-6, "aten::copy_": 10e-6, "aten::relu": 5e-6}
    )


def test_the_collector_accepts_copies_and_keeps_them_inside_compute() -> None:
    """``copy_s`` and the cost's lasting fields are optional on the wire: the collector's
    schema takes an entry with them (folding copies into compute, its stored parts still
    summing to the step) and one without them (an older agent)."""
    from stepwatch_server.schemas.ingest import ProfileIn

    e = build_entry(load_chrome_trace(FIXTURES / "cuda_ddp_synthetic_rank0.json"), first_step=4, n_steps=2)
    e["cost"] = {
        "window_s": 0.2,
        "on_thread_s": 0.01,
        "slowdown_s": 0.0,
        "parse_cpu_s": 0.01,
        "lasting_s": 0.18,
        "lasting_ratio": 0.15,
        "every": 100,
        "next_every": 200,
    }
    p = ProfileIn.model_validate(e)
    assert p.compute_s == pytest.approx([560e-6, 370e-6]) and p.copy_s is None
    assert p.cost is not None and p.cost.lasting_s == pytest.approx(0.18)
    old = {k: v for k, v in e.items() if k not in ("copy_s", "cost")}
    old["compute_s"] = [c + k for c, k in zip(e["compute_s"], e["copy_s"], strict=True)]
    assert ProfileIn.model_validate(old).compute_s == pytest.approx(p.compute_s)
    bad = {**e, "copy_s": [0.0]}
    with pytest.raises(ValueError, match="copy_s has 1 values"):
        ProfileIn.model_validate(bad)
