"""Faults the simulator can inject, and how they are written on the command line.

``KIND:key=value,...`` with ``at`` (first window, 0-based) and optional ``until``
(exclusive):

=========  ==========================================  ===============================
kind       what happens                                 keys (defaults)
=========  ==========================================  ===============================
compute    one rank computes longer (throttled GPU)     rank, mag (0.2 = +20%)
link       one rank's link is slow: every group it      rank, mag (0.5 = +50% transfer)
           belongs to transfers slower
data       one rank's data loader stalls                rank, mag (s per step, 0.15)
host       every rank of one host computes longer       host (index), mag (0.2)
mfu        the job slows down: one breakdown component  mag (0.05 = MFU -5%),
           grows so that MFU falls by ``mag``           component (comm_exposed_s)
hang       the job stops: no rank reports a step        rank (the stuck one, 0)
           again (in synchronous training one stuck
           rank stops all at the next collective)
silent     one rank's agent goes silent while the       rank
           job keeps stepping
=========  ==========================================  ===============================

Example: ``compute:rank=13,at=20,mag=0.2`` or ``mfu:at=200,mag=0.05``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FaultKind = Literal["compute", "link", "data", "host", "mfu", "hang", "silent"]
KINDS: tuple[str, ...] = ("compute", "link", "data", "host", "mfu", "hang", "silent")
COMPONENTS: tuple[str, ...] = ("compute_s", "comm_exposed_s", "data_wait_s", "idle_s")
_DEFAULT_MAG = {
    "compute": 0.2,
    "link": 0.5,
    "data": 0.15,
    "host": 0.2,
    "mfu": 0.05,
    "hang": 0.0,
    "silent": 0.0,
}


@dataclass(frozen=True)
class Fault:
    """One injected fault (see the module docstring)."""

    kind: FaultKind
    at: int
    target: int = 0
    mag: float = 0.0
    until: int | None = None
    component: str = "comm_exposed_s"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault {self.kind!r}; one of {', '.join(KINDS)}")
        if self.at < 0 or (self.until is not None and self.until <= self.at):
            raise ValueError("need 0 <= at < until")
        if self.component not in COMPONENTS:
            raise ValueError(f"component must be one of {', '.join(COMPONENTS)}")
        if self.kind == "mfu" and not 0.0 < self.mag < 1.0:
            raise ValueError("an mfu drop is a fraction in (0, 1)")

    def active(self, window: int) -> bool:
        return window >= self.at and (self.until is None or window < self.until)

    @property
    def spec(self) -> str:
        """The command-line form of this fault."""
        key = "host" if self.kind == "host" else "rank"
        parts = [f"at={self.at}"]
        if self.kind != "mfu":
            parts.insert(0, f"{key}={self.target}")
        if self.kind not in ("hang", "silent"):
            parts.append(f"mag={self.mag:g}")
        if self.until is not None:
            parts.append(f"until={self.until}")
        if self.kind == "mfu" and self.component != "comm_exposed_s":
            parts.append(f"component={self.component}")
        return f"{self.kind}:" + ",".join(parts)


def parse_fault(text: str) -> Fault:
    """Parse ``KIND:key=value,...``; raises ``ValueError`` with what is wrong."""
    kind, _, rest = text.partition(":")
    kind = kind.strip().lower()
    if kind not in KINDS:
        raise ValueError(f"unknown fault {kind!r} in {text!r}; one of {', '.join(KINDS)}")
    values: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"expected key=value, got {item!r} in {text!r}")
        values[key.strip().lower()] = value.strip()
    allowed = {"at", "until", "mag", "rank", "host", "component"}
    unknown = set(values) - allowed
    if unknown:
        raise ValueError(f"unknown key(s) {sorted(unknown)} in {text!r}")
    try:
        target = int(values.get("host" if kind == "host" else "rank", "0"))
        return Fault(
            kind=kind,  # type: ignore[arg-type]
            at=int(values.get("at", "0")),
            target=target,
            mag=float(values.get("mag", _DEFAULT_MAG[kind])),
            until=int(values["until"]) if "until" in values else None,
            component=values.get("component", "comm_exposed_s"),
        )
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bad fault {text!r}: {exc}") from exc
