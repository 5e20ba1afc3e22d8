"""Number formatting for the one-sentence messages a person reads in an alert."""

from __future__ import annotations

import time
from collections.abc import Sequence


def step(n: int) -> str:
    """A step number with thousands separators: ``41,200``."""
    return f"{n:,}"


def secs(x: float) -> str:
    """Seconds with precision that suits the magnitude: ``12.3 s``, ``0.31 s``, ``0.004 s``."""
    ax = abs(x)
    if ax >= 10.0:
        return f"{x:.1f} s"
    if ax >= 0.01 or ax == 0.0:
        return f"{x:.2f} s"
    return f"{x:.3f} s"


def signed_secs(x: float) -> str:
    """Seconds with an explicit sign: ``+1.10 s``."""
    body = secs(abs(x))
    return ("-" if x < 0 else "+") + body


def pct(r: float, digits: int = 1) -> str:
    """A 0-1 ratio as a percentage: ``8.1%``."""
    return f"{100.0 * r:.{digits}f}%"


def signed_pct(r: float) -> str:
    """A signed relative change: ``-9.0%``."""
    return ("-" if r < 0 else "+") + pct(abs(r))


def duration(x: float) -> str:
    """A span of wall time in the unit a person thinks in: ``45 s``, ``12.5 min``, ``3.2 h``."""
    if x < 120.0:
        return f"{x:.0f} s"
    if x < 7200.0:
        return f"{x / 60.0:.1f} min"
    if x < 172800.0:
        return f"{x / 3600.0:.1f} h"
    return f"{x / 86400.0:.2f} days"


def clock(unix_s: float) -> str:
    """A moment as a person reads it in an alert: ``10:42:07 UTC``."""
    return time.strftime("%H:%M:%S UTC", time.gmtime(unix_s))


def ranks(rs: Sequence[int], limit: int = 8) -> str:
    """``rank 5``, ``ranks 2, 5``, ``ranks 0, 1, ... (12)``: at most ``limit`` named."""
    shown = ", ".join(str(r) for r in rs[:limit])
    more = f", ... ({len(rs)})" if len(rs) > limit else ""
    return f"rank{'s' if len(rs) != 1 else ''} {shown}{more}"
