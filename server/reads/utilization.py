"""MFU from tokens/s, given a run's stored FLOPs convention: one definition for every reader.

MFU = tokens/s x FLOPs per token / (devices x dense peak FLOP/s of one device), so the
factor that turns tokens/s into MFU depends only on the convention and the world size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def per_token_rate(
    convention: Mapping[str, Any] | None, world_size: int, flops_key: str = "flops_per_token"
) -> float | None:
    """MFU (or HFU, with ``flops_key="hfu_flops_per_token"``) per token/s; None when the
    convention has no peak (an unknown device) or no FLOPs for that key."""
    conv = convention or {}
    flops, peak = conv.get(flops_key), conv.get("peak_flops")
    if not flops or not peak or world_size <= 0:
        return None
    return float(flops) / (world_size * float(peak))


#: What the API, the page and ``stepwatch top`` say where MFU is missing for want of a peak.
MFU_NEEDS_PEAK = "MFU needs a peak FLOP/s: pass peak_flops= (see README: finding a peak)"
MFU_NEEDS_FLOPS = "MFU needs the model's FLOPs per token: pass model= or flops_per_token="


def mfu_unavailable(convention: Mapping[str, Any] | None, world_size: int) -> str | None:
    """Why a run has no MFU (what to pass to ``stepwatch.init``), or None when it has one."""
    conv = convention or {}
    if not conv.get("peak_flops"):
        return MFU_NEEDS_PEAK
    if not conv.get("flops_per_token"):
        return MFU_NEEDS_FLOPS
    return None
