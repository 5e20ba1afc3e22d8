"""Straggler flags from the always-on collective timing, window by window.

:mod:`.arrivals` says, for one window of one peer group, which ranks arrived last at the
collectives on most steps and why (extra data wait, extra training-thread CPU, or
neither: a stalled host), and which hosts had their ranks late together. This module
turns those verdicts into compute, host-stall and slow-host flags with the persistence
and hysteresis of every straggler flag: each window's verdict becomes a
:class:`~.peers.WindowVerdict` that advances a :class:`~.stragglers.StragglerDetector`
of its own, so the keys (``straggler:compute:rank=2``, ``straggler:host:host=node-b``),
messages, costs and JSON state are those of the profiler-based detector, and the
findings/events path (API, page, ``/metrics``, webhook) carries them unchanged.

A late rank opens a flag after ``OPEN_AFTER`` (2) consecutive late windows, the
persistence of :func:`.arrivals.persistent`: the sign test already needs most steps of a
window, and one late window (a GC pause, a scheduler hiccup) opens nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from . import _format as fmt
from .arrivals import Config, HostFinding, LateRank, RankSteps, late_ranks, line_up, slow_hosts
from .peers import Hit, StragglerConfig, WindowVerdict, host_key, rank_key
from .stragglers import StragglerDetector
from .types import Cause, Finding

#: Consecutive late windows that open a flag, clean ones that close it.
OPEN_AFTER = 2
CLOSE_AFTER = 3
#: The per-rank causes this detector flags. A late rank whose loader wait explains it is
#: left to the window detector (``peers.py``), which sees loader wait on every step and
#: names it as ``straggler:data:rank=N`` already: two detectors would open the same key.
CAUSES: tuple[Cause, ...] = ("compute", "host_stall")


class ArrivalDetector:
    """Late-arrival straggler flags of one run (see the module docstring)."""

    def __init__(self, run: str, config: Config | None = None) -> None:
        self.config = config or Config()
        self.flags = StragglerDetector(run, StragglerConfig(open_after=OPEN_AFTER, close_after=CLOSE_AFTER))

    def update(self, window: int, groups: Sequence[Sequence[RankSteps]]) -> list[Finding]:
        """One window's timing, per peer group (ranks doing the same work, e.g. the
        replicas of one pipeline stage); returns the flags that opened or closed."""
        hits: dict[str, Hit] = {}
        observed: set[str] = set()
        first = last = 0
        for group in groups:
            if len(group) < 2:
                continue
            aligned = line_up(group)
            if not aligned.steps:
                continue
            first = min(first or aligned.steps[0], aligned.steps[0])
            last = max(last, aligned.steps[-1])
            span = (aligned.steps[0], aligned.steps[-1])
            for r, h in zip(aligned.ranks, aligned.hosts, strict=True):
                observed.update(rank_key(c, r) for c in CAUSES)
                observed.add(host_key(h))
            late = late_ranks(aligned, self.config)
            for x in late:
                if x.cause == "data":
                    continue  # the window detector's: loader wait is measured on every step
                hit = _rank_hit(x, span)
                hits[hit.key] = hit
            for host in slow_hosts(aligned, late, self.config):
                hit = _host_hit(host, late, span)
                hits[hit.key] = hit
        if not observed:
            return []  # no timing in this window: it neither advances nor resets a flag
        return self.flags.apply(WindowVerdict(window, first, last, hits, frozenset(observed)))

    def open_findings(self) -> list[Finding]:
        return self.flags.open_findings()

    def to_state(self) -> dict[str, Any]:
        return self.flags.to_state()

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> ArrivalDetector:
        out = cls(str(state["run"]))
        out.flags = StragglerDetector.from_state(state)
        return out


def _evidence(x: LateRank) -> dict[str, float]:
    ev = {k: v for k, v in x.evidence.items() if not math.isnan(v)}
    ev.update({"late_steps": float(x.late_steps), "steps": float(x.steps), "p_value": x.p_value})
    return ev


def _why(x: LateRank) -> str:
    if x.cause == "compute":
        return (
            f"{fmt.secs(x.evidence['extra_cpu_s'])} more training-thread CPU per step than its peers' "
            f"{fmt.secs(x.evidence['peer_cpu_s'])}"
        )
    return "no extra CPU or loader wait: the host stalled (a sleep, a slow callback, a pause)"


def _rank_hit(x: LateRank, span: tuple[int, int]) -> Hit:
    detail = (
        f"its peers waited for it at the gradient all-reduce on {x.late_steps} of {x.steps} steps, "
        f"{fmt.secs(x.lateness_s)} per step ({fmt.pct(x.share)} of the step, sign test p={x.p_value:.3f}); "
        + _why(x)
    )
    return Hit(
        key=rank_key(x.cause, x.rank),
        cause=x.cause,
        ranks=(x.rank,),
        hosts=(x.host,),
        first_step=span[0],
        last_step=span[1],
        cost_seconds=x.lateness_s,
        step_time_s=x.evidence["step_time_s"],
        evidence=_evidence(x),
        detail=detail,
    )


def _host_hit(h: HostFinding, late: Sequence[LateRank], span: tuple[int, int]) -> Hit:
    mine = [x for x in late if x.rank in h.ranks]
    step = max(x.evidence["step_time_s"] for x in mine)
    detail = (
        f"ranks {', '.join(map(str, h.ranks))} arrived last together, up to {fmt.secs(h.lateness_s)} "
        f"per step; cause on its ranks: {h.cause}"
    )
    return Hit(
        key=host_key(h.host),
        cause="host",
        ranks=h.ranks,
        hosts=(h.host,),
        first_step=span[0],
        last_step=span[1],
        cost_seconds=h.lateness_s,
        step_time_s=step,
        evidence={"lateness_s": h.lateness_s, "ranks_late": float(len(h.ranks))},
        detail=detail,
        underlying=h.cause if h.cause != "host" else None,
    )
