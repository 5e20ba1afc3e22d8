"""Synthetic Kineto (torch.profiler) Chrome traces of CUDA training, built in code.

The layout follows real traces of multi-GPU training (HTA's ``tests/data`` traces from
V100 and A100 jobs, facebookresearch/HolisticTraceAnalysis at f4d0062c): host events
(``cpu_op``, ``user_annotation``) on the main thread, ``cuda_runtime`` launches with a
``correlation`` that grows with every launch, GPU events (``kernel``, ``gpu_memcpy``,
``gpu_memset``) with the same ``correlation`` on ``pid`` = device, ``tid`` = stream, and
``distributedInfo`` / ``baseTimeNanoseconds`` at the top. What those traces show and the
builders here reproduce: the GPU runs behind its host, so the trace opens on the tail
of the step before the window, whose GPU work has no launch in the trace and
correlation ids below every launch; older PyTorch leaves ``Collective name`` off the
kernels (``ncclKernel_SendRecv_*`` launched inside ``c10d::alltoall_base_`` >
``record_param_comms`` > ``nccl:all_to_all``). Every number is chosen here, so each test
can say what the parser must find.
"""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PID = 4242
MAIN = 4242
DEVICE = 0
COMPUTE_STREAM = 7
NCCL_STREAM = 20
BASE_NS = 1_764_000_000_000_000_000  # baseTimeNanoseconds: a Unix time (2025-11)
GEMM = "sm80_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x32_stage4_warpsize2x2x1_tensor16x8x16_kernel"
ADAMW = "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::FusedAdamMathFunctor>"
NCCL_AR = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"
NCCL_SENDRECV_OLD = "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclWorkElem)"
MEMCPY = "Memcpy HtoD (Pinned -> Device)"


@dataclass
class KinetoTrace:
    """A trace under construction; times in microseconds from the trace's base."""

    rank: int = 0
    world: int = 2
    next_corr: int = 10_000
    events: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def host(
        self, name: str, ts: float, dur: float, *, cat: str = "cpu_op", tid: int = MAIN, **args: Any
    ) -> None:
        self.events.append(
            {"ph": "X", "cat": cat, "name": name, "pid": PID, "tid": tid, "ts": ts, "dur": dur, "args": args}
        )

    def step(self, n: int, ts: float, dur: float) -> None:
        self.host(f"ProfilerStep#{n}", ts, dur, cat="user_annotation")

    def gpu(
        self,
        name: str,
        start: float,
        dur: float,
        *,
        launch_at: float | None,
        cat: str = "kernel",
        stream: int = COMPUTE_STREAM,
        corr: int | None = None,
        tid: int = MAIN,
        **args: Any,
    ) -> int:
        """Device work; ``launch_at=None`` leaves its launch out of the trace."""
        if corr is None:
            corr = self.next_corr
            self.next_corr += 1
        if launch_at is not None:
            api = "cudaLaunchKernel" if cat == "kernel" else "cudaMemcpyAsync"
            self.host(api, launch_at, 4.0, cat="cuda_runtime", tid=tid, correlation=corr, cbid=211)
        self.events.append(
            {
                "ph": "X",
                "cat": cat,
                "name": name,
                "pid": DEVICE,
                "tid": stream,
                "ts": start,
                "dur": dur,
                "args": {
                    "device": DEVICE,
                    "stream": stream,
                    "correlation": corr,
                    "External id": corr,
                    **args,
                },
            }
        )
        return corr

    def to_dict(self) -> dict[str, Any]:
        return {
            "schemaVersion": 1,
            "distributedInfo": {"backend": "nccl", "rank": self.rank, "world_size": self.world},
            "baseTimeNanoseconds": BASE_NS,
            "traceEvents": self.events,
            **self.extra,
        }

    def write(self, path: Path) -> Path:
        text = json.dumps(self.to_dict())
        if path.name.endswith(".gz"):
            with gzip.open(path, "wt", encoding="utf-8") as fh:
                fh.write(text)
        else:
            path.write_text(text)
        return path


def training_trace(
    *,
    rank: int = 0,
    world: int = 2,
    steps: int = 4,
    first_step: int = 10,
    step_us: float = 10_000.0,
    lag_us: float = 6_500.0,
    late_us: float = 0.0,
    last_arrival_us: float = 0.0,
    transfer_us: float = 3_000.0,
    jitter: float = 0.02,
    seed: int = 0,
) -> KinetoTrace:
    """A DDP-like rank whose GPU runs ``lag_us`` behind its host.

    Per step, with ``d`` the device step start (host start + lag) and ``S`` the step:
    memcpy [d, d+0.05S], GEMM [d+0.05S, d+0.55S], NCCL all_reduce from its arrival
    ``d+0.4S+late_us`` to ``d+0.4S+last_arrival_us+transfer_us`` (the last rank's
    arrival plus the transfer), AdamW [d+0.6S, d+0.95S]; every duration scaled by a
    seeded jitter of +-``jitter``. The step before the window runs too: what of it
    starts after the trace opens (at 0) is recorded without launches, under lower
    correlation ids, as CUPTI records it.
    """
    rng = random.Random(seed)
    t = KinetoTrace(rank=rank, world=world)
    s = step_us

    def j(x: float) -> float:
        return x * (1.0 + rng.uniform(-jitter, jitter))

    def device_step(i: int, launched: bool) -> None:
        h = i * s  # host start of step i
        d = h + lag_us
        work = [
            (MEMCPY, "gpu_memcpy", d, j(0.05 * s), COMPUTE_STREAM, {}),
            (GEMM, "kernel", d + 0.05 * s, j(0.5 * s), COMPUTE_STREAM, {}),
            (
                NCCL_AR,
                "kernel",
                d + 0.4 * s + late_us,
                last_arrival_us - late_us + j(transfer_us),
                NCCL_STREAM,
                {
                    "Collective name": "allreduce",
                    "In msg nelems": 1 << 20,
                    "Out msg nelems": 1 << 20,
                    "dtype": "BFloat16",
                    "Group size": world,
                    "Process Group Name": "0",
                    "Process Group Ranks": str(list(range(world))),
                },
            ),
            (ADAMW, "kernel", d + 0.6 * s, j(0.35 * s), COMPUTE_STREAM, {}),
        ]
        for k, (name, cat, start, dur, stream, args) in enumerate(work):
            if not launched:
                if start >= 0:  # CUPTI records what starts after the profiler did
                    t.gpu(
                        name,
                        start,
                        dur,
                        launch_at=None,
                        cat=cat,
                        stream=stream,
                        corr=500 + 10 * (i + 5) + k,
                        **args,
                    )
                continue
            launch = h + (0.02 + 0.1 * k) * s
            if name == NCCL_AR:
                seq = 100 + i
                t.host("c10d::allreduce_", launch - 20, 60)
                t.host("record_param_comms", launch - 10, 40, Seq=seq, **{"Collective name": "allreduce"})
                t.host("nccl:all_reduce", launch - 5, 20, cat="user_annotation")
            t.gpu(name, start, dur, launch_at=launch, cat=cat, stream=stream, **args)

    device_step(-1, launched=False)
    for i in range(steps):
        t.step(first_step + i, i * s, s)
        device_step(i, launched=True)
    return t
