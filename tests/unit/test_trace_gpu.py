"""CUDA trace rules on traces shaped like real ones (tests/kineto.py says what it mirrors):
first-step attribution, communication by launching host op, op names and bytes from
older PyTorch, copies as their own part."""

from __future__ import annotations

import statistics
from typing import Any

import pytest

from stepwatch.profiler.breakdown import total, union
from stepwatch.profiler.trace import parse_chrome_trace, window_breakdown

from ..kineto import GEMM, MAIN, MEMCPY, NCCL_SENDRECV_OLD, KinetoTrace, training_trace


def test_the_first_step_of_a_lagging_gpu_equals_the_steady_steps() -> None:
    """The GPU runs 0.65 steps behind its host: the trace opens on the previous step's
    NCCL and AdamW kernels, recorded without launches. They belong to no profiled step:
    the first device step starts when they have drained (0.6 S after the host step), so
    it is one step long, like the others, instead of 1.6 steps."""
    s = 10_000.0
    raw = training_trace(steps=5, step_us=s, lag_us=0.65 * s, jitter=0.02, seed=3).to_dict()
    w = parse_chrome_trace(raw)
    times = [b.step_s for b in window_breakdown(w)]
    steady = statistics.median(times[1:])
    assert steady == pytest.approx(s * 1e-6, rel=0.05)
    assert times[0] == pytest.approx(steady, rel=0.05), times
    assert w.steps[0][0] == pytest.approx(0.6 * s, rel=0.05), "starts when the previous step's tail drained"
    # The tail is accounted apart: the AdamW and NCCL kernels of step -1 (0.35 S + 0.3 S).
    assert w.before_window_us == pytest.approx(0.65 * s, rel=0.05)
    # No stray collective: every all_reduce in the steps has its sequence number.
    first = w.steps[0][0]
    in_steps = [r for r in w.collectives if r.start_us >= first]
    assert [r.seq for r in in_steps] == [100, 101, 102, 103, 104]


def test_a_tail_the_trace_does_not_hold_is_read_off_the_first_launchs_wait() -> None:
    """The agent's second window on an H200: CUPTI recorded nothing launched before the
    window, while the device was still 0.9 steps behind. The window's first kernel,
    launched at once, started 0.9 steps later: the first step starts there (as an event
    recorded at the boundary completes there), not at the host boundary (which made
    that step 1.9 steps long, 14 ms of it idle)."""
    s = 10_000.0
    t = KinetoTrace()
    for i in range(3):
        t.step(1 + i, i * s, s)
        t.gpu(GEMM, i * s + 0.9 * s, s, launch_at=i * s + 100.0)
    w = parse_chrome_trace(t.to_dict())
    assert [b.step_s * 1e6 for b in window_breakdown(w)] == pytest.approx([s, s, s])
    assert w.steps[0][0] == pytest.approx(0.9 * s)
    assert w.before_window_us == pytest.approx(0.9 * s)
    assert total(w.compute) == pytest.approx(3 * s)


def test_a_step_that_opens_with_host_work_on_an_idle_device_keeps_its_start() -> None:
    """5 ms of data loading, then a launch that starts 60 µs after its call (a slow launch
    on an idle device): too short a wait to say the device was busy for 5 ms."""
    t = KinetoTrace()
    t.step(1, 0.0, 10_000.0)
    t.gpu(GEMM, 5_064.0, 4_000.0, launch_at=5_000.0)  # call 5,000-5,004, start 60 µs later
    w = parse_chrome_trace(t.to_dict())
    assert w.steps == [(0.0, 10_000.0)] and w.before_window_us == 0.0


def test_only_the_training_threads_launches_tell_a_tail() -> None:
    """A prefetch thread's copy that waited on a busy copy engine says nothing about the
    training stream: the step starts where its host span does."""
    t = KinetoTrace()
    t.step(1, 0.0, 10_000.0)
    t.gpu(MEMCPY, 6_000.0, 500.0, launch_at=10.0, cat="gpu_memcpy", stream=9, tid=MAIN + 1)
    t.gpu(GEMM, 120.0, 9_000.0, launch_at=100.0)
    w = parse_chrome_trace(t.to_dict())
    assert w.steps == [(0.0, 10_000.0)] and w.before_window_us == 0.0


def test_the_profilers_start_is_cut_only_up_to_the_first_op() -> None:
    """An overhead event that outlasts the training thread's first op did not hold it."""
    t = KinetoTrace()
    t.step(1, 0.0, 10_000.0)
    t.host("Activity Buffer Request", 10.0, 3_000.0, cat="overhead", tid=0)
    t.host("aten::mm", 1_000.0, 50.0)
    t.gpu(GEMM, 1_040.0, 8_000.0, launch_at=1_030.0)
    w = parse_chrome_trace(t.to_dict())
    assert w.steps == [(1_000.0, 10_000.0)]


def test_work_without_a_launch_but_inside_the_correlation_range_stays_where_it_ran() -> None:
    """A lost launch record (correlation above the first launch) is not pre-window work."""
    t = KinetoTrace()
    t.step(1, 0.0, 1000.0)
    t.gpu(GEMM, 100.0, 200.0, launch_at=50.0)  # correlation 10000
    t.gpu(GEMM, 400.0, 200.0, launch_at=None, corr=10_005)
    w = parse_chrome_trace(t.to_dict())
    assert w.steps == [(0.0, 1000.0)] and w.before_window_us == 0.0
    assert total(w.compute) == 400.0


def _one_step(*build: Any) -> KinetoTrace:
    t = KinetoTrace(world=8)
    t.step(1, 0.0, 1000.0)
    for f in build:
        f(t)
    return t


def test_symmetric_memory_all_reduce_is_communication_by_its_host_op() -> None:
    """B200 trace: ``multimem_all_reduce_kernel`` launched by ``symm_mem::multimem_all_reduce_``
    carries no "nccl" in its name; it is communication, an all_reduce of the host op's bytes."""

    def build(t: KinetoTrace) -> None:
        t.gpu(GEMM, 100.0, 300.0, launch_at=10.0)
        t.host(
            "symm_mem::multimem_all_reduce_",
            20.0,
            30.0,
            **{"Input Dims": [[4096, 1024]], "Input type": ["c10::BFloat16"]},
        )
        t.gpu(
            "void c10d::symmetric_memory::multimem_all_reduce_kernel<c10::BFloat16, 16>",
            400.0,
            200.0,
            launch_at=25.0,
        )

    w = parse_chrome_trace(_one_step(build).to_dict())
    assert total(w.comm) == 200.0 and total(w.compute) == 300.0
    (r,) = w.collectives
    assert (r.op, r.bytes, r.start_us, r.dur_us) == ("all_reduce", 4096 * 1024 * 2, 400.0, 200.0)


def test_older_pytorch_all_to_all_takes_op_and_bytes_from_the_host_ops() -> None:
    """DLRM on older PyTorch: a bare SendRecv kernel, no ``Collective name``; the host ops
    around its launch say all_to_all, ``c10d::alltoall_base_(out, in, ...)`` the sizes."""

    def build(t: KinetoTrace) -> None:
        dims = {"Input Dims": [[2883584], [3145728], [], []], "Input type": ["float", "float", "", "Scalar"]}
        t.host("c10d::alltoall_base_", 10.0, 100.0, **dims)
        t.host("record_param_comms", 20.0, 80.0)
        t.host(
            "nccl:all_to_all",
            30.0,
            60.0,
            cat="user_annotation",
            **{"Input Dims": [[3145728]], "Input type": ["float"]},
        )
        t.gpu(
            NCCL_SENDRECV_OLD,
            200.0,
            500.0,
            launch_at=40.0,
        )

    (r,) = parse_chrome_trace(_one_step(build).to_dict()).collectives
    assert (r.op, r.bytes) == ("all_to_all", 3145728 * 4)


def test_nccl_annotation_bytes_of_an_all_gather_scale_by_the_group() -> None:
    def build(t: KinetoTrace) -> None:
        t.host(
            "c10d::allgather_",
            10.0,
            100.0,
            **{"Input Dims": [[], []], "Input type": ["TensorList", "TensorList"]},
        )
        t.host(
            "nccl:all_gather",
            30.0,
            60.0,
            cat="user_annotation",
            **{"Input Dims": [[1024]], "Input type": ["float"]},
        )
        t.gpu("ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclWorkElem)", 200.0, 100.0, launch_at=40.0)

    (r,) = parse_chrome_trace(_one_step(build).to_dict()).collectives
    assert (r.op, r.bytes) == ("all_gather", 1024 * 4 * 8), "input x world size (8, from distributedInfo)"


def test_deepep_kernels_launched_outside_torch_ops_are_communication_by_name() -> None:
    def build(t: KinetoTrace) -> None:
        t.gpu(
            "void deep_ep::intranode::dispatch<8, 768, 8192>(int4*, float*, int*)",
            100.0,
            50.0,
            launch_at=10.0,
        )
        t.gpu(
            "void deep_ep::intranode::combine<nv_bfloat16, 8, 768>(nv_bfloat16*)", 300.0, 40.0, launch_at=20.0
        )
        t.gpu(
            "void at::native::reduce_kernel<512, 1>(at::native::ReduceOp<float>)", 500.0, 40.0, launch_at=30.0
        )

    w = parse_chrome_trace(_one_step(build).to_dict())
    assert [(r.op, r.dur_us) for r in w.collectives] == [("all_to_all", 50.0), ("all_to_all", 40.0)]
    assert total(w.compute) == 40.0, "a reduce kernel is compute"


def test_copies_are_their_own_part_unless_a_collective_launched_them() -> None:
    def build(t: KinetoTrace) -> None:
        t.gpu("Memcpy HtoD (Pinned -> Device)", 100.0, 100.0, launch_at=10.0, cat="gpu_memcpy")
        t.gpu("Memset (Device)", 150.0, 100.0, launch_at=11.0, cat="gpu_memset")
        t.gpu(GEMM, 300.0, 200.0, launch_at=12.0)
        t.host("c10d::allgather_", 20.0, 50.0)
        t.gpu("Memcpy DtoD (Device -> Device)", 600.0, 100.0, launch_at=30.0, cat="gpu_memcpy")

    w = parse_chrome_trace(_one_step(build).to_dict())
    assert w.copies == [(100.0, 250.0)] and w.compute == [(300.0, 500.0)] and w.comm == [(600.0, 700.0)]
    (b,) = window_breakdown(w)
    assert b.copy_s == pytest.approx(150e-6) and b.compute_s == pytest.approx(200e-6)
    assert b.comm_exposed_s == pytest.approx(100e-6)
    parts = b.compute_s + b.copy_s + b.comm_overlapped_s + b.comm_exposed_s + b.data_wait_s + b.idle_s
    assert parts == pytest.approx(b.step_s)


def test_share_of_device_time_that_is_communication_counts_host_classified_kernels() -> None:
    """The figure the issue measured on B200: 20% of busy time was a symm_mem all-reduce."""

    def build(t: KinetoTrace) -> None:
        t.gpu(GEMM, 0.0, 800.0, launch_at=1.0)
        t.host("symm_mem::multimem_all_reduce_", 2.0, 5.0)
        t.gpu("multimem_all_reduce_kernel", 800.0, 200.0, launch_at=3.0)

    w = parse_chrome_trace(_one_step(build).to_dict())
    busy = total(union(w.compute, w.comm, w.copies))
    assert total(w.comm) / busy == pytest.approx(0.2)
