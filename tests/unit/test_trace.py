"""Profiler trace -> breakdown intervals and collective records."""

from __future__ import annotations

import gzip
import itertools
import json
import math
from dataclasses import astuple
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepwatch.profiler.breakdown import StepBreakdown, intersect, total, union
from stepwatch.profiler.chrome import (
    TraceEvent,
    events_from_chrome_trace,
    load_chrome_trace,
    trace_from_profiler,
)
from stepwatch.profiler.trace import WindowTrace, classify_events, parse_chrome_trace, window_breakdown

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
CPU_TRACE = FIXTURES / "cpu_gloo_ddp_rank0.json"
GPU_TRACE = FIXTURES / "cuda_ddp_synthetic_rank0.json"


def _parts(b: StepBreakdown) -> list[float]:
    return [b.compute_s, b.comm_overlapped_s, b.comm_exposed_s, b.data_wait_s, b.idle_s]


def _x(name: str, ts: float, dur: float, cat: str = "cpu_op", tid: int = 1, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _trace(*events: object, **top: Any) -> dict[str, Any]:
    return {"traceEvents": list(events), **top}


# -- reading -------------------------------------------------------------------------


def test_events_keep_complete_events_and_skip_malformed_ones() -> None:
    raw = _trace(
        _x("aten::mm", 10.0, 5.0),
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "python"}},
        {"ph": "s", "id": 3, "pid": 1, "tid": 1, "ts": 1.0, "cat": "ac2g", "name": "ac2g"},
        {"ph": "X", "name": "no-ts", "dur": 1.0},
        {"ph": "X", "name": "nan-dur", "ts": 1.0, "dur": math.nan},
        {"ph": "X", "name": 7, "ts": 1.0, "dur": 1.0},
        {"ph": "X", "name": "negative", "ts": 1.0, "dur": -3.0, "pid": "Spans", "tid": None},
        "not an event",
    )
    evs = events_from_chrome_trace(raw)
    assert [e.name for e in evs] == ["aten::mm", "negative"]
    assert evs[0] == TraceEvent("aten::mm", "cpu_op", 10.0, 5.0, 1, 1, {})
    assert evs[1].dur_us == 0.0 and evs[1].tid == "None"
    with pytest.raises(ValueError, match="traceEvents"):
        events_from_chrome_trace({"nope": []})


def test_load_plain_and_gzipped(tmp_path: Path) -> None:
    data = _trace(_x("aten::mm", 1.0, 1.0))
    (tmp_path / "t.json").write_text(json.dumps(data))
    with gzip.open(tmp_path / "t.json.gz", "wt") as fh:
        json.dump(data, fh)
    assert load_chrome_trace(tmp_path / "t.json") == data
    assert load_chrome_trace(tmp_path / "t.json.gz") == data
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(ValueError, match="JSON object"):
        load_chrome_trace(tmp_path / "list.json")


def test_trace_from_profiler_exports_loads_and_cleans_up() -> None:
    written: list[Path] = []

    class FakeProfile:
        def export_chrome_trace(self, path: str) -> None:
            written.append(Path(path))
            Path(path).write_text(json.dumps(_trace(_x("ProfilerStep#1", 0.0, 10.0, cat="user_annotation"))))

    trace = trace_from_profiler(FakeProfile())
    assert parse_chrome_trace(trace).steps == [(0.0, 10.0)]
    assert written and not written[0].exists()


# -- CPU rules -------------------------------------------------------------------------


def test_cpu_rules_on_a_small_hand_made_trace() -> None:
    """Main thread 1 owns the steps; gloo runs on thread 2; a helper thread 3 iterates a loader.

    Step [0, 100]. Loader 0-10 (with collate's aten::stack 2-8 inside); forward annotation
    10-60 wraps ops 12-20 and 30-40; an autograd op 40-55 contains the c10d launch 50-52;
    gloo:all_reduce 52-80 on the worker; the main thread waits (no op) until 80; optimizer
    op 82-90. Thread 3's loader span and python_function spans must be ignored.
    """
    raw = _trace(
        _x("ProfilerStep#7", 0, 100, cat="user_annotation"),
        _x("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 0, 10, cat="user_annotation"),
        _x("aten::stack", 2, 6),
        _x("DistributedDataParallel.forward", 10, 50, cat="user_annotation"),
        _x("aten::linear", 12, 8),
        _x("aten::relu", 30, 10),
        _x("autograd::engine::evaluate_function: AddmmBackward0", 40, 15),
        _x("c10d::allreduce_", 50, 2),
        _x("gloo:all_reduce", 52, 28, cat="user_annotation", tid=2, **{"Input type": ["float"]}),
        _x("aten::add_", 82, 8),
        _x(
            "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__",
            20,
            60,
            cat="user_annotation",
            tid=3,
        ),
        _x("train.py(12): main", 0, 100, cat="python_function"),
    )
    w = parse_chrome_trace(raw)
    assert w.device == "cpu"
    assert w.step_numbers == [7]
    assert w.steps == [(0.0, 100.0)]
    assert w.data_wait == [(0.0, 10.0)]
    assert w.compute == [(12.0, 20.0), (30.0, 50.0), (52.0, 55.0), (82.0, 90.0)]
    assert w.comm == [(50.0, 80.0)]
    (b,) = window_breakdown(w)
    # overlapped 52-55 (3), compute-only 8+20+8 (36), exposed 50-52 + 55-80 (27), idle 24
    assert astuple(b.scaled(1e6)) == pytest.approx(astuple(StepBreakdown(100.0, 36.0, 3.0, 27.0, 10.0, 24.0)))
    (rec,) = w.collectives
    assert (rec.op, rec.start_us, rec.dur_us, rec.bytes, rec.group_name) == (
        "all_reduce",
        52.0,
        28.0,
        None,
        None,
    )


def test_gloo_reduce_scatter_runs_as_all_reduce_and_takes_the_launch_name() -> None:
    raw = _trace(
        _x("ProfilerStep#1", 0, 100, cat="user_annotation"),
        _x("c10d::_reduce_scatter_base_", 10, 2),
        _x(
            "gloo:all_reduce",
            11,
            20,
            cat="user_annotation",
            tid=2,
            **{"Input type": ["float"], "Input Dims": [[1000]]},
        ),
        _x("c10d::_allgather_base_", 40, 2),
        _x(
            "gloo:all_gather",
            41,
            5,
            cat="user_annotation",
            tid=2,
            **{"Input type": ["float"], "Input Dims": [[500]]},
        ),
        distributedInfo={"backend": "gloo", "pg_config": [{"pg_name": "0", "pg_size": 2, "ranks": [0, 1]}]},
    )
    recs = parse_chrome_trace(raw).collectives
    assert [(r.op, r.bytes, r.group_size, r.group_ranks) for r in recs] == [
        ("reduce_scatter", 4000, 2, (0, 1)),
        ("all_gather", 4000, 2, (0, 1)),  # the gathered output: 500 floats x 2 ranks
    ]


def test_without_profiler_steps_the_busiest_thread_is_main_and_there_are_no_steps() -> None:
    w = classify_events(
        events_from_chrome_trace(_trace(_x("aten::mm", 0, 5, tid=4), _x("aten::mm", 9, 1, tid=5)))
    )
    assert w.steps == [] and w.compute == [(0.0, 5.0)]
    assert window_breakdown(w) == []
    assert classify_events([]).steps == []


def test_real_cpu_gloo_ddp_trace() -> None:
    """Rank 0 of 2-rank gloo DDP, torch 2.13 CPU, recorded by tests/fixtures/make_cpu_trace.py."""
    raw = load_chrome_trace(CPU_TRACE)
    assert CPU_TRACE.stat().st_size < 300_000
    w = parse_chrome_trace(raw)
    assert w.device == "cpu"
    assert len(w.steps) == 2 and w.step_numbers == [2, 3]
    steps = window_breakdown(w)
    for b in steps:
        assert b.step_s > 0
        assert b.compute_s > 0
        assert b.comm_s > 0
        assert b.data_wait_s > 0
        assert math.fsum(_parts(b)) == pytest.approx(b.step_s, abs=1e-9)
    # DDP's gradient bucket: 33,088 float parameters of the tiny MLP, on the default group.
    assert [c.op for c in w.collectives] == ["all_reduce", "all_reduce"]
    for c in w.collectives:
        assert (c.bytes, c.group_name, c.group_size, c.group_ranks, c.seq) == (
            33_088 * 4,
            "0",
            2,
            (0, 1),
            None,
        )
        assert c.dur_us > 0
    # Launches on the main thread are communication, never compute.
    events = events_from_chrome_trace(raw)
    launches = union(e.span for e in events if e.name.startswith("c10d::"))
    assert launches and total(intersect(w.compute, launches)) == 0.0
    assert total(intersect(w.compute, w.data_wait)) == 0.0


# -- CUDA rules ------------------------------------------------------------------------


def test_synthetic_cuda_ddp_trace_matches_the_hand_computed_breakdown() -> None:
    """Fixture written by tests/fixtures/make_gpu_trace.py (see its docstring for what it mirrors).

    Times in µs from T0. Host ProfilerStep#4 = [0, 1000], #5 = [1000, 2000].
    GPU, step 4: memcpy 120-140, gemm 150-400, gelu 400-450, gemm 460-700,
    NCCL all_reduce 600-900, AdamW 950-1050 (launched at 800, i.e. in step 4).
    GPU, step 5: memcpy 1320-1340, gemm 1350-1500, gemm 1500-1700, NCCL 1650-1900,
    AdamW 1900-1950. Loader spans on the host: 0-100 and 1000-1300.

    Device step boundaries: 0; max(1000, 1050) = 1050; max(2000, 1950) = 2000.
    Step 4 = [0, 1050]: data wait 0-100 = 100; kernels 300 + 240 + 100 = 640,
    copies 20 (memcpy, beside no kernel), comm 300, overlapped 600-700 = 100,
    compute only 540, exposed 200, idle 100-120, 140-150, 450-460, 900-950 = 90.
    Step 5 = [1050, 2000]: data wait 1050-1300 = 250 (1000-1050 the GPU was still
    busy with AdamW: not a stall); kernels 350 + 50 = 400, copies 20, comm 250,
    overlapped 1650-1700 = 50, compute only 350, exposed 200, idle 20 + 10 + 50 = 80.
    """
    w = parse_chrome_trace(load_chrome_trace(GPU_TRACE))
    t0 = 5_099_495_338_000.0
    assert w.device == "cuda"
    assert w.step_numbers == [4, 5]
    assert [(s - t0, e - t0) for s, e in w.steps] == [(0.0, 1050.0), (1050.0, 2000.0)]
    assert [(s - t0, e - t0) for s, e in w.data_wait] == [(0.0, 100.0), (1050.0, 1300.0)]
    got = [b.scaled(1e6) for b in window_breakdown(w)]
    assert astuple(got[0]) == pytest.approx((1050.0, 540.0, 100.0, 200.0, 100.0, 90.0, 20.0))
    assert astuple(got[1]) == pytest.approx((950.0, 350.0, 50.0, 200.0, 250.0, 80.0, 20.0))
    assert got[0].overlap_ratio == pytest.approx(1 / 3)
    assert got[1].overlap_ratio == pytest.approx(0.2)
    recs = w.collectives
    assert [(r.op, r.start_us - t0, r.dur_us, r.seq) for r in recs] == [
        ("all_reduce", 600.0, 300.0, 17),
        ("all_reduce", 1650.0, 250.0, 18),
    ]
    for r in recs:
        assert (r.bytes, r.group_name, r.group_size, r.group_ranks) == (2 * 1_048_576, "0", 2, (0, 1))


def test_cuda_collective_name_from_record_param_comms_when_the_kernel_lacks_it() -> None:
    host: dict[str, Any] = {"External id": 9, "Collective name": "all_to_allv", "Seq": 3}
    raw = _trace(
        _x("record_param_comms", 0, 5, **host),
        _x(
            "ncclDevKernel_SendRecv(ncclDevComm*, unsigned long, ncclWork*)",
            10,
            5,
            cat="kernel",
            tid=20,
            **{"External id": 9},
        ),
        _x("ncclDevKernel_SendRecv(ncclDevComm*, unsigned long, ncclWork*)", 20, 5, cat="kernel", tid=20),
    )
    recs = parse_chrome_trace(raw).collectives
    assert [(r.op, r.seq, r.bytes) for r in recs] == [("all_to_all", 3, None), ("send_recv", None, None)]


def test_window_breakdown_of_an_empty_window() -> None:
    w = WindowTrace(steps=[], compute=[], comm=[], data_wait=[], collectives=[], device="cpu")
    assert window_breakdown(w) == []


_t = st.floats(0.0, 1000.0, allow_nan=False)
_ivs = st.lists(st.tuples(_t, _t).map(lambda p: (min(p), max(p))), max_size=10)


@settings(max_examples=100, deadline=None)
@given(st.lists(_t, min_size=2, max_size=5, unique=True), _ivs, _ivs, _ivs)
def test_window_parts_sum_to_each_step(
    bounds: list[float],
    compute: list[tuple[float, float]],
    comm: list[tuple[float, float]],
    wait: list[tuple[float, float]],
) -> None:
    b = sorted(bounds)
    w = WindowTrace(
        steps=list(itertools.pairwise(b)),
        compute=union(compute),
        comm=union(comm),
        data_wait=union(wait),
        collectives=[],
        device="cpu",
    )
    for sb, (s, e) in zip(window_breakdown(w), w.steps, strict=True):
        assert sb.step_s == pytest.approx((e - s) * 1e-6)
        assert math.fsum(_parts(sb)) == pytest.approx(sb.step_s, abs=1e-9)


def test_live_torch_profiler_on_gloo(tmp_path: Path) -> None:
    """What the installed torch writes today still parses: one gloo rank, no global process group."""
    torch = pytest.importorskip("torch")
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not hasattr(dist, "ProcessGroupGloo"):
        pytest.skip("torch.distributed with gloo is not available")
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    pg = dist.ProcessGroupGloo(dist.FileStore(str(tmp_path / "store"), 1), 0, 1)
    model = torch.nn.Linear(16, 16)
    sched = schedule(wait=0, warmup=1, active=2, repeat=1)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, schedule=sched) as prof:
        for _ in range(3):
            with record_function("stepwatch.data_wait"):
                x = torch.randn(4, 16)
            model(x).sum().backward()
            for p in model.parameters():
                pg.allreduce([p.grad]).wait()
            prof.step()
    w = parse_chrome_trace(trace_from_profiler(prof))
    assert len(w.steps) == 2
    assert {c.op for c in w.collectives} == {"all_reduce"}
    assert sorted(c.bytes or 0 for c in w.collectives) == [64, 64, 1024, 1024]  # bias, weight: float32
    for b in window_breakdown(w):
        assert b.compute_s > 0 and b.comm_s > 0 and b.data_wait_s > 0
        assert math.fsum(_parts(b)) == pytest.approx(b.step_s, abs=1e-9)
