"""A capture explanation: why a flagged rank is slow, from a profiler capture of it and its peers.

When a rank is flagged as a straggler, the collector asks it and its peers to run
torch.profiler over the same few steps. Each rank's summary alone says little (is 12 ms of
``aten::mm`` a lot?); the explanation is the comparison a person would otherwise do by
hand: the flagged rank's top ops, data wait, collective transfer and wait, and SM clock
against its peers', in one line such as ``rank 5: GEMM kernels 1.6x its peers' median,
all_reduce transfer normal, SM clock 1,410 vs 1,980 MHz (power cap)``.

Every comparison is with the *median* of the peers, not their mean: one other slow rank
(a second straggler not yet flagged, a GC pause during the capture) must not raise the
reference and hide the difference we are looking for. Peers are the captured ranks that
are not flagged; ranks that missed the capture are never part of a median.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CapturedRank", "CollectiveTimes", "Explanation", "OpTime", "explain", "peers_median"]

#: An op (or compute as a whole) this many times its peers' median is named.
OP_RATIO = 1.2
#: An op absent from every peer's top list is named when it takes this share of the step.
ONLY_HERE_SHARE = 0.05
#: Extra data wait worth naming, as a share of the peers' median step.
DATA_WAIT_SHARE = 0.2
#: A collective's transfer this many times its peers' median is named.
TRANSFER_RATIO = 1.3
#: The flagged rank waits less than this share of its peers' wait: they wait for it.
WAIT_SHARE = 0.5
#: Peers' wait below this (seconds) is noise, not waiting for a straggler.
MIN_PEER_WAIT_S = 1e-3
#: An SM clock below this share of the peers' median is named.
CLOCK_SHARE = 0.95
MAX_OPS = 2
MAX_TOP_OPS = 5
MAX_MESSAGE = 400


@dataclass(frozen=True, slots=True)
class OpTime:
    """One entry of a rank's top ops (most self time per step)."""

    name: str
    self_s: float
    count: float


@dataclass(frozen=True, slots=True)
class CollectiveTimes:
    """One collective type on one rank over the captured steps (medians; None when unknown)."""

    count: int
    duration_s: float | None
    wait_s: float | None
    transfer_s: float | None


@dataclass(frozen=True, slots=True)
class CapturedRank:
    """One rank's profiler summary of a capture; ``n_steps == 0`` when it missed it."""

    rank: int
    host: str | None
    n_steps: int
    skipped: str | None
    step_s: float | None
    compute_s: float | None
    comm_overlapped_s: float | None
    comm_exposed_s: float | None
    data_wait_s: float | None
    idle_s: float | None
    top_ops: tuple[OpTime, ...] = ()
    collectives: Mapping[str, CollectiveTimes] = field(default_factory=dict)
    device: str | None = None
    sm_clock_mhz: float | None = None
    power_w: float | None = None
    temperature_c: float | None = None
    throttle_reasons: tuple[str, ...] = ()
    cost_s: float | None = None

    @property
    def missed(self) -> bool:
        return self.n_steps <= 0 or self.skipped is not None


@dataclass(frozen=True, slots=True)
class Explanation:
    """Per-rank summaries, per-flagged-rank phrases, and the one line a person reads."""

    per_rank: dict[int, dict[str, Any]]
    findings: dict[int, list[str]]
    message: str
    missed: dict[int, str]

    def to_evidence(self) -> dict[str, Any]:
        """JSON-ready (string keys), as stored with the finding and served by the API."""
        return {
            "per_rank": {str(r): v for r, v in self.per_rank.items()},
            "findings": {str(r): list(v) for r, v in self.findings.items()},
            "message": self.message,
            "missed": {str(r): v for r, v in self.missed.items()},
        }


def peers_median(values: Sequence[float | None]) -> float | None:
    """Median of the known (non-None, finite) values; None when there are none.

    Unknown values are left out rather than counted as zero: a peer that did not measure
    its wait must not pull the reference down."""
    known = [v for v in values if v is not None and math.isfinite(v)]
    return float(statistics.median(known)) if known else None


def _r(x: float | None) -> float | None:
    return round(x, 6) if x is not None and math.isfinite(x) else None


def _pair(a: float, b: float) -> tuple[str, str, str]:
    """Two durations in one unit (ms, or µs when both are below 1 ms), so they compare at a glance."""
    if max(abs(a), abs(b)) >= 1e-3:
        return f"{a * 1e3:.1f}", f"{b * 1e3:.1f}", "ms"
    return f"{a * 1e6:.0f}", f"{b * 1e6:.0f}", "µs"


def _summary(c: CapturedRank) -> dict[str, Any]:
    ops = sorted(c.top_ops, key=lambda o: -o.self_s)[:MAX_TOP_OPS]
    return {
        "host": c.host,
        "n_steps": c.n_steps,
        "skipped": c.skipped,
        "breakdown": {
            k: _r(getattr(c, k))
            for k in ("step_s", "compute_s", "comm_overlapped_s", "comm_exposed_s", "data_wait_s", "idle_s")
        },
        "top_ops": [{"name": o.name, "self_s": _r(o.self_s), "count": _r(o.count)} for o in ops],
        "collectives": {
            op: {"count": t.count, **{k: _r(getattr(t, k)) for k in ("duration_s", "wait_s", "transfer_s")}}
            for op, t in c.collectives.items()
        },
        "sm_clock_mhz": _r(c.sm_clock_mhz),
        "throttle_reasons": list(c.throttle_reasons),
        "cost_s": _r(c.cost_s),
    }


def _med(peers: Sequence[CapturedRank], get: Callable[[CapturedRank], float | None]) -> float | None:
    return peers_median([get(p) for p in peers])


#: Op and kernel names of communication (their time is the collectives' wait and transfer,
#: compared apart: a straggler's collective *call* can take longer on CPU, which read as
#: an op 3x its peers' would point at the network instead of at its compute).
COMM_OPS = ("c10d::", "gloo", "nccl", "record_param_comms", "allreduce", "all_reduce", "all_gather")


def is_comm_op(name: str) -> bool:
    low = name.lower()
    return any(tag in low for tag in COMM_OPS)


def _op_phrases(f: CapturedRank, peers: Sequence[CapturedRank]) -> list[str]:
    """The ops that take the most extra time on ``f``; compute as a whole when none does.
    Communication ops are left to the collectives' phrases."""
    peer_ops = [{o.name: o.self_s for o in p.top_ops} for p in peers]
    scored: list[tuple[float, str]] = []
    for op in f.top_ops:
        if is_comm_op(op.name):
            continue
        med = peers_median([ops.get(op.name) for ops in peer_ops])
        if med is None or med <= 0:
            if f.step_s and op.self_s >= ONLY_HERE_SHARE * f.step_s:
                a, _, unit = _pair(op.self_s, op.self_s)
                scored.append((op.self_s, f"{op.name} only on rank {f.rank} ({a} {unit} per step)"))
        elif op.self_s / med >= OP_RATIO:
            a, b, unit = _pair(op.self_s, med)
            text = f"{op.name} {op.self_s / med:.1f}x its peers' median ({a} vs {b} {unit} per step)"
            scored.append((op.self_s - med, text))
    scored.sort(key=lambda s: -s[0])
    if scored:
        return [text for _, text in scored[:MAX_OPS]]
    med = _med(peers, lambda p: p.compute_s)
    if f.compute_s is not None and med and f.compute_s / med >= OP_RATIO:
        return [f"compute {f.compute_s / med:.1f}x its peers' median (no single op stands out)"]
    return []


def _data_phrase(f: CapturedRank, peers: Sequence[CapturedRank]) -> list[str]:
    med, step = _med(peers, lambda p: p.data_wait_s), _med(peers, lambda p: p.step_s)
    if f.data_wait_s is None or med is None or not step or f.data_wait_s - med < DATA_WAIT_SHARE * step:
        return []
    a, b, unit = _pair(f.data_wait_s, med)
    return [f"data wait {a} {unit} per step vs {b} {unit}"]


def _collective_phrases(f: CapturedRank, peers: Sequence[CapturedRank]) -> tuple[list[str], bool]:
    """Slow transfers, and waits that show the peers waiting for ``f``; also whether a
    difference was found (a "transfer normal" phrase rules the network out, it is not one)."""
    phrases: list[str] = []
    normal_named = found = False
    for op, t in sorted(f.collectives.items(), key=lambda kv: (-kv[1].count, kv[0])):
        theirs = [p.collectives[op] for p in peers if op in p.collectives]
        if not theirs:
            continue
        med = peers_median([c.transfer_s for c in theirs])
        if t.transfer_s is not None and med:
            if t.transfer_s / med >= TRANSFER_RATIO:
                phrases.append(f"{op} transfer {t.transfer_s / med:.1f}x its peers'")
                found = True
            elif not normal_named:  # only the busiest op type, to keep the line short
                phrases.append(f"{op} transfer normal")
                normal_named = True
        wait = peers_median([c.wait_s for c in theirs])
        if (
            t.wait_s is not None
            and wait is not None
            and wait >= MIN_PEER_WAIT_S
            and t.wait_s < WAIT_SHARE * wait
        ):
            a, b, unit = _pair(t.wait_s, wait)
            phrases.append(
                f"its peers wait for it at {op} (rank {f.rank} waits {a} {unit}, peers {b} {unit})"
            )
            found = True
    return phrases, found


def _clock_phrase(f: CapturedRank, peers: Sequence[CapturedRank]) -> list[str]:
    med = _med(peers, lambda p: p.sm_clock_mhz)
    if f.sm_clock_mhz is None or med is None or f.sm_clock_mhz >= CLOCK_SHARE * med:
        return []
    text = f"SM clock {f.sm_clock_mhz:,.0f} vs {med:,.0f} MHz"
    reasons = f.throttle_reasons
    if any("power" in r for r in reasons):
        return [text + " (power cap)"]
    if any("thermal" in r for r in reasons):
        return [text + " (thermal)"]
    return [text + (f" (throttled: {', '.join(reasons)})" if reasons else "")]


def _compare(f: CapturedRank, peers: Sequence[CapturedRank]) -> list[str]:
    """The phrases for ``f``: ops/compute, data, collectives, clocks, in that order."""
    ops, data, clock = _op_phrases(f, peers), _data_phrase(f, peers), _clock_phrase(f, peers)
    coll, coll_found = _collective_phrases(f, peers)
    phrases = [*ops, *data, *coll, *clock]
    if not (ops or data or coll_found or clock):
        med = _med(peers, lambda p: p.step_s)
        tail = ""
        if f.step_s is not None and med is not None:
            a, b, unit = _pair(f.step_s, med)
            tail = f" (step {a} vs {b} {unit})"
        phrases.append("no difference found in the captured steps" + tail)
    return phrases


def explain(ranks: Sequence[CapturedRank], flagged: Sequence[int]) -> Explanation:
    """Compare each flagged rank of a capture with the median of its peers.

    Peers are the captured ranks that are not flagged; when every captured rank is
    flagged, each is compared with the others (better than no comparison at all)."""
    by_rank = {c.rank: c for c in ranks}
    missed = {c.rank: c.skipped or "no steps captured" for c in ranks if c.missed}
    captured = [c for c in ranks if not c.missed]
    wanted = list(dict.fromkeys(flagged))
    unflagged = [c for c in captured if c.rank not in set(flagged)]
    findings: dict[int, list[str]] = {}
    for r in wanted:
        f = by_rank.get(r)
        if f is None:
            missed[r] = "no report"
        if f is None or f.missed:
            findings[r] = [f"missed the capture ({missed[r]})"]
            continue
        peers = unflagged or [c for c in captured if c.rank != r]
        findings[r] = _compare(f, peers) if peers else ["no peer captured to compare with"]
    message = "; ".join(f"rank {r}: " + ", ".join(p) for r, p in findings.items())
    if len(message) > MAX_MESSAGE:
        message = message[: MAX_MESSAGE - 1] + "…"
    per_rank = {c.rank: _summary(c) for c in ranks}
    return Explanation(per_rank=per_rank, findings=findings, message=message, missed=missed)
