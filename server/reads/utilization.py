"""Why a run has no MFU, said the same way by the API, the page and ``stepwatch top``.

The MFU factor itself is the agent's (:func:`stepwatch.flops.per_token_rate`), so the
collector serves the formula the agent's tests check; this module only names what is
missing and what to pass to ``stepwatch.init``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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
