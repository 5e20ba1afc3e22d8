"""Build ingest payloads with the agent's own code (so tests prove the two sides agree)."""

from __future__ import annotations

import time
from array import array
from collections.abc import Sequence
from typing import Any

from stepwatch._env import Layout, RankInfo, coords_for
from stepwatch._payload import build_payload, new_batch_id
from stepwatch._window import TAG_CODES, Window

CONVENTION = {
    "formula": "explicit",
    "attention": None,
    "flops_per_token": 1.0e9,
    "hfu_flops_per_token": None,
    "dtype": "bf16",
    "device_name": "test-device",
    "peak_flops": 1.0e14,
    "peak_source": "user",
    "id": "explicit/bf16/test-device@100TFLOPs[user]",
}


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
    profile: dict[str, Any] | None = None,
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
        profile=profile,
    )
