"""The step range of a downsampled series and the width of its buckets.

Both series readers (per step, ``queries.py``; per rank window, ``profiles.py``) cut a
requested step range into at most ``max_points`` buckets of equal step width.
"""

from __future__ import annotations

import math
from typing import NamedTuple


class Buckets(NamedTuple):
    from_step: int
    to_step: int
    width: int


def buckets(
    lo: int | None, hi: int | None, from_step: int | None, to_step: int | None, max_points: int
) -> Buckets | None:
    """The range to read (the requested bounds, else the stored ``lo``/``hi``) and its
    bucket width; None when there is nothing to read."""
    if from_step is None or to_step is None:
        if lo is None or hi is None:
            return None
        from_step = lo if from_step is None else from_step
        to_step = hi if to_step is None else to_step
    if to_step < from_step:
        return None
    return Buckets(from_step, to_step, max(1, math.ceil((to_step - from_step + 1) / max_points)))
