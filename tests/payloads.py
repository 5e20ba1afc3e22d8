"""Build ingest payloads with the agent's own code (so tests prove the two sides agree)."""

from __future__ import annotations

import time
from array import array
from collections.abc import Sequence
from typing import Any

from stepwatch._env import Layout, RankInfo, coords_for
from stepwatch._payload import build_payload, new_batch_id
from stepwatch._window import Window
from stepwatch.flops import resolve_convention
from stepwatch.wire import TAG_CODES

#: The convention as the agent resolves and sends it (explicit FLOPs per token, a user peak).
CONVENTION = resolve_convention(
    flops_per_token=1.0e9, peak_flops=1.0e14, device_name="test-device", dtype="bf16"
).to_dict()


def rank_info(rank: int, world: int, host: str | None = None, tp: int = 1, pp: int = 1) -> dict[str, Any]:
    layout = Layout(dp=world // (tp * pp), tp=tp, pp=pp)
    return RankInfo(
        rank=rank,
        local_rank=rank % 8,
        world_size=world,
        host=host or f"node{rank // 8}",
        layout=layout,
        coords=coords_for(rank, layout),
    ).to_dict()


def payload(
    *,
    run: str = "test-run",
    rank: int = 0,
    world: int = 1,
    first: int = 1,
    times: Sequence[float] = (0.5, 0.5, 0.5, 0.5),
    waits: Sequence[float] | None = None,
    tokens: Sequence[int] | None = None,
    padded: Sequence[int] | None = None,
    tags: Sequence[str | None] | None = None,
    convention: dict[str, Any] | None = CONVENTION,
    batch_id: str | None = None,
    host: str | None = None,
    wall_end: float | None = None,
    final: bool = False,
    plan: dict[str, Any] | None = None,
    profiles: Sequence[dict[str, Any]] | None = None,
    comm: dict[str, Any] | None = None,
    profiles_through: int | None = None,
) -> dict[str, Any]:
    n = len(times)
    window = Window(
        first_step=first,
        step_time_s=array("d", times),
        data_wait_s=array("d", waits if waits is not None else [0.0] * n),
        tokens=array("q", tokens if tokens is not None else [1000] * n),
        padded_tokens=array("q", padded) if padded is not None else None,
        tags=array("b", [TAG_CODES[t] if t else 0 for t in tags]) if tags is not None else None,
        wall_end=time.time() if wall_end is None else wall_end,
        batch_id=batch_id or new_batch_id(),
        final=final,
        profiles_through=profiles_through,
    )
    agent = {
        "version": "0.1.0",
        "clock": "host",
        "dropped_windows": 0,
        "dropped_steps": 0,
        "hot_path_mean_s": 4e-7,
    }
    return build_payload(
        window,
        run=run,
        rank=rank_info(rank, world, host),
        convention=convention,
        agent=agent,
        sent_at=time.time(),
        plan=plan,
        profiles=profiles,
        comm=comm,
    )


def comm_section(n: int, *, buckets: int = 8, first_step: int = 1) -> dict[str, Any]:
    """The ``comm`` section the agent's hook timing builds for ``n`` steps of 0.5 s with
    ``buckets`` all-reduces each (summarised by the agent's own code)."""
    from stepwatch._comm_timing import CommTiming

    pos = [first_step, 0]
    timing = CommTiming(max(n, 1), lambda: (pos[0], pos[1]))
    for i in range(n):
        pos[1] = i
        for b in range(buckets):
            token = timing.arrive("world", b, 4096)
            timing.done(token, "world")
    slices = timing.take(n)
    assert slices is not None
    return timing.summarise(slices, first_step, [0.5] * n, perf_end=time.perf_counter())


def profile_entry(
    *,
    first_step: int,
    enter: Sequence[float],
    end: Sequence[float],
    compute: float = 0.3,
    overlapped: float = 0.05,
    exposed: float = 0.05,
    data_wait: float = 0.01,
    step_s: float = 0.5,
    ranks: Sequence[int] | None = (0, 1, 2, 3),
    t0: float = 1.8e9,
    offset_s: float = 0.0,
) -> dict[str, Any]:
    """A profile entry as the agent builds it: one all-reduce per step, ``enter``/``end``
    per step (seconds after ``t0``), constant breakdown parts."""
    from stepwatch.sketch import LogSketch

    n = len(enter)
    sk = LogSketch(0.01)
    for a, b in zip(enter, end, strict=True):
        sk.add(b - a)
    return {
        "first_step": first_step,
        "n_steps": n,
        "device": "cpu",
        "t0": t0,
        "time_s": [step_s] * n,
        "compute_s": [compute] * n,
        "comm_overlapped_s": [overlapped] * n,
        "comm_exposed_s": [exposed] * n,
        "data_wait_s": [data_wait] * n,
        "idle_s": [step_s - compute - overlapped - exposed - data_wait] * n,
        "top_ops": [{"name": "aten::mm", "self_s": compute / 2, "count": 12.0}],
        "collectives": [{"op": "all_reduce", "count": n, "bytes": 4096 * n, "duration": sk.to_dict()}],
        "arrivals": [
            {
                "group": "0",
                "ranks": list(ranks) if ranks is not None else None,
                "size": len(ranks) if ranks is not None else None,
                "key_kind": "order",
                "step": [first_step + j for j in range(n)],
                "op": ["all_reduce"] * n,
                "key": [0] * n,
                "enter": list(enter),
                "end": list(end),
            }
        ],
        "clock": {"offset_s": offset_s, "uncertainty_s": 0.0, "method": "same-host"},
        "nvml": None,
        "cost": {
            "window_s": 0.05,
            "on_thread_s": 0.02,
            "slowdown_s": 0.01,
            "parse_cpu_s": 0.02,
            "every": 100,
            "next_every": 100,
            "overhead_ratio": 0.001,
        },
    }
