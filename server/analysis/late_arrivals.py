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

Links (the agent's per-connection timing, :mod:`.links`) add two things: a rank whose
every data connection is slow opens ``straggler:link:rank=R`` (a slow link shows on the
links, not in the arrivals: the ring moves at its pace for every rank), and a late rank
with no extra CPU that sent far more bytes than its peers is named ``link`` instead of
``host_stall`` (it spent the time communicating: extra collectives on its own link). A
rank named for its link in a window is not also named for compute or a host stall in it,
and while a slow link holds up a group no rank of it is named a host stall, nor any rank
at the other end of the slow rank's connections: the rank that finishes the ring's
all-reduce last starts its next step late with no extra work, and the ranks that send
through the slow link spend longer (and more CPU) in each transfer; both are the slow
link's doing (seen on real ranks in namespaces: beside the right ``link:rank=1``, a tbf
run flagged ``host_stall:rank=3`` and another ``compute:rank=2``, its ring neighbour).
Only lateness the link can explain is set aside: up to the time per step lost on the
slow link; a rank later than that is still named (the demo's +1 s/step compute straggler
beside a link that looked slow for one window on a loaded loopback).

The converse holds too: a compute straggler slows the connections of its ring neighbour.
In the demo beside a CPU burner (rank 2 given 120 ms of extra compute per step, about 50 ms
more training-thread CPU on 4 ranks sharing 2 cores, loopback), both connections of rank 3
(data flows from rank r to r-1) ran at 65-95 MB/s while the two others ran at 127-493,
in three consecutive 8-step windows of the slowdown (never both at once before it): rank
3 was named ``link`` (23-32 ms lost per step) beside the right ``compute:rank=2`` in 2 of
19 such runs, and once in a solo phase of the suite. A slow link is set aside when a rank
at the other end of one of its connections is late for compute with more extra
training-thread CPU per step than the time lost on the link: a slow link cannot make a
peer's training thread busy for longer than the transfer time it costs, so the extra work
is the cause. (The recorded ``tc tbf`` run at 150 Mbit/s loses 126-140 ms per step on the
link, while the ranks' CPU differs by under 10 ms.) The price: a real slow link beside a
compute straggler whose extra CPU outweighs what the link loses is not named while the
straggler lasts; the straggler, the larger cost, is.

A late rank opens a flag after ``OPEN_AFTER`` (2) consecutive late windows, the
persistence of :func:`.arrivals.persistent`: the sign test already needs most steps of a
window, and one late window (a GC pause, a scheduler hiccup) opens nothing.

A rank late because its training thread waited for a core (``cpu_contention``: extra
run-queue wait explains the lateness) needs ``CONTENTION_OPEN_AFTER`` (4) windows, and so
does a host whose ranks were late together for that reason: on a host whose cores are
all busy the scheduler leaves one rank, then another, waiting for a few seconds by
chance (ten clean real runs beside a CPU burner had two such ranks named host stalls
over two 8-step windows), while contention that holds a rank back for minutes (another
job's processes on its host, too many loader workers) is worth a flag. Its flags run in
a detector of their own, with that persistence.

Each test holds at least :attr:`.arrivals.Config.min_steps` (8) steps: a peer group's
consecutive windows are pooled until they do, and judged together as one verdict (at the
window that completed the pool); windows that leave a pool short give no verdict (they
neither advance nor reset a flag). The collector fixes a run's window size at its first
batch, from the step times it saw then; the first steps of a job are slow (start-up,
warm-up, a loaded host), and on a busy machine real runs got 1- and 2-step windows, on
which no sign test can reach ``max_p`` (2 of 2 late is p = 0.25): a rank with +20% real
compute went unflagged for the whole run. Pooling disjoint blocks, not sliding over
overlapping ones, keeps the statistics of windows of ``min_steps`` steps: consecutive
verdicts rest on different steps, so ``OPEN_AFTER`` of them are independent evidence
and a clean run is as quiet as with large windows. Windows of ``min_steps`` or more
steps are judged one by one, as before. The pool of a group (fewer than ``min_steps``
steps of each rank, and its links' samples) is part of the detector's state; a group
whose ranks changed starts a new pool (its old steps no longer line up).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _format as fmt
from .arrivals import (
    Aligned,
    Config,
    HostFinding,
    LateRank,
    RankSteps,
    late_ranks,
    line_up,
    slow_hosts,
    stack,
)
from .links import LinkConfig, LinkSample, SlowLink, edges, extra_bytes, merge, slow_links
from .peers import Hit, StragglerConfig, WindowVerdict, host_key, rank_key
from .stragglers import StragglerDetector
from .types import Cause, Finding

#: Consecutive late windows that open a flag, clean ones that close it.
OPEN_AFTER = 2
CLOSE_AFTER = 3
#: Consecutive late windows that open a ``cpu_contention`` flag (module docstring).
CONTENTION_OPEN_AFTER = 4
#: The per-rank causes this detector flags. A late rank whose loader wait explains it is
#: left to the window detector (``peers.py``), which sees loader wait on every step and
#: names it as ``straggler:data:rank=N`` already: two detectors would open the same key.
CAUSES: tuple[Cause, ...] = ("compute", "host_stall", "link", "cpu_contention")


@dataclass(frozen=True, slots=True)
class _Pool:
    """A peer group's steps waiting for enough to test (see the module docstring)."""

    aligned: Aligned
    links: tuple[LinkSample, ...]


class ArrivalDetector:
    """Late-arrival straggler flags of one run (see the module docstring)."""

    def __init__(self, run: str, config: Config | None = None, links: LinkConfig | None = None) -> None:
        self.config = config or Config()
        self.link_config = links or LinkConfig()
        self.flags = StragglerDetector(run, StragglerConfig(open_after=OPEN_AFTER, close_after=CLOSE_AFTER))
        #: ``cpu_contention`` flags, of ranks and of hosts (see the module docstring).
        self.contention = StragglerDetector(
            run, StragglerConfig(open_after=CONTENTION_OPEN_AFTER, close_after=CLOSE_AFTER)
        )
        self._pools: dict[tuple[int, ...], _Pool] = {}

    def update(
        self, window: int, groups: Sequence[Sequence[RankSteps]], links: Sequence[LinkSample] = ()
    ) -> list[Finding]:
        """One window's timing, per peer group (ranks doing the same work, e.g. the
        replicas of one pipeline stage), and its link samples; returns the flags that
        opened or closed. A group is judged once its pooled steps are enough for the
        test (see the module docstring)."""
        hits: dict[str, Hit] = {}
        observed: set[str] = set()
        first = last = 0
        for aligned, mine in self._pooled(groups, links):
            first = min(first or aligned.steps[0], aligned.steps[0])
            last = max(last, aligned.steps[-1])
            span = (aligned.steps[0], aligned.steps[-1])
            heavy = extra_bytes(mine, self.link_config) if mine else {}
            for r, h in zip(aligned.ranks, aligned.hosts, strict=True):
                observed.update(rank_key(c, r) for c in CAUSES if c != "link" or mine)
                observed.add(host_key(h))
            slow = self._slow_links(aligned, mine, span) if mine else {}
            late = late_ranks(aligned, self.config)
            slow = {r: h for r, h in slow.items() if _computed_away(h, late, mine) is None}
            hits.update({h.key: h for h in slow.values()})
            if slow:  # see the module docstring: a slow link explains up to its lost time
                lost = max(h.cost_seconds for h in slow.values())
                near = _link_peers(mine, set(slow))
                late = [
                    x for x in late if x.lateness_s > lost or (x.cause != "host_stall" and x.rank not in near)
                ]
            for x in late:
                if x.cause == "data":
                    continue  # the window detector's: loader wait is measured on every step
                if x.rank in slow and x.lateness_s <= slow[x.rank].cost_seconds:
                    continue  # its link explains it
                hit = _rank_hit(x, span, heavy.get(x.rank) if x.cause == "host_stall" else None)
                hits[hit.key] = hit
            for host in slow_hosts(aligned, late, self.config):
                hit = _host_hit(host, late, span)
                hits[hit.key] = hit
        if not observed:
            return []  # no group judged in this window: it neither advances nor resets a flag
        slow_cpu = {k: h for k, h in hits.items() if _contention(h)}
        others = {k: h for k, h in hits.items() if k not in slow_cpu}
        seen = frozenset(observed)
        return [
            *self.flags.apply(WindowVerdict(window, first, last, others, seen)),
            *self.contention.apply(WindowVerdict(window, first, last, slow_cpu, seen)),
        ]

    def _pooled(
        self, groups: Sequence[Sequence[RankSteps]], links: Sequence[LinkSample]
    ) -> list[tuple[Aligned, list[LinkSample]]]:
        """The groups to judge now, each with its pooled steps and its ranks' link
        samples; the others' steps are kept for the next window."""
        ready: list[tuple[Aligned, list[LinkSample]]] = []
        seen: set[tuple[int, ...]] = set()
        for group in groups:
            if len(group) < 2:
                continue
            aligned = line_up(group)
            members = set(aligned.ranks)
            mine = [s for s in links if s.rank in members]
            seen.add(aligned.ranks)
            held = self._pools.pop(aligned.ranks, None)
            if held is not None:
                aligned = stack(held.aligned, aligned)
                mine = [*held.links, *mine]
            if len(aligned.steps) >= self.config.min_steps:
                ready.append((aligned, merge(mine)))
            elif aligned.steps or mine:
                self._pools[aligned.ranks] = _Pool(aligned, tuple(merge(mine)))
        for key in set(self._pools) - seen:
            del self._pools[key]  # the group's ranks changed: its steps no longer line up
        return ready

    def _slow_links(
        self, aligned: Aligned, links: Sequence[LinkSample], span: tuple[int, int]
    ) -> dict[int, Hit]:
        """Link hits of one peer group's ranks, by rank."""
        step_ref = float(np.nanmedian(aligned.step_time)) if aligned.step_time.size else 0.0
        members = set(aligned.ranks)
        mine = [s for s in links if s.rank in members]
        found = slow_links(mine, step_time_s=step_ref, cfg=self.link_config)
        return {
            x.rank: _link_hit(x, aligned.hosts[aligned.ranks.index(x.rank)], span, step_ref) for x in found
        }

    def open_findings(self) -> list[Finding]:
        return [*self.flags.open_findings(), *self.contention.open_findings()]

    def to_state(self) -> dict[str, Any]:
        """The flags' state, and the pools of steps not judged yet."""
        return {
            **self.flags.to_state(),
            "pools": [_pool_to_dict(p) for _, p in sorted(self._pools.items())],
            "contention": self.contention.to_state(),
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> ArrivalDetector:
        out = cls(str(state["run"]))
        out.flags = StragglerDetector.from_state(state)
        if "contention" in state:  # absent in a state saved before it
            out.contention = StragglerDetector.from_state(state["contention"])
        for raw in state.get("pools", ()):  # absent in a state saved before pooling
            pool = _pool_from_dict(raw)
            out._pools[pool.aligned.ranks] = pool
        return out


_MATRICES = ("step_time", "wait", "transfer", "cpu", "data_wait", "runq")


def _pool_to_dict(p: _Pool) -> dict[str, Any]:
    """JSON-ready (NaN as null: JSON has no NaN, and PostgreSQL's JSON types refuse it)."""
    a = p.aligned
    out: dict[str, Any] = {"ranks": list(a.ranks), "hosts": list(a.hosts), "steps": list(a.steps)}
    for name in _MATRICES:
        m: np.ndarray[Any, Any] = getattr(a, name)
        out[name] = [[None if math.isnan(v) else v for v in row] for row in m.tolist()]
    out["links"] = [
        [s.rank, s.local, s.peer, s.bytes_sent, s.bytes_received, s.busy_s, s.steps] for s in p.links
    ]
    return out


def _pool_from_dict(d: Mapping[str, Any]) -> _Pool:
    n = len(d["ranks"])

    def matrix(rows: Sequence[Sequence[float | None]]) -> np.ndarray[Any, np.dtype[np.float64]]:
        m = np.array([[math.nan if v is None else float(v) for v in row] for row in rows], dtype=np.float64)
        return m.reshape(len(rows), n)

    aligned = Aligned(
        ranks=tuple(int(r) for r in d["ranks"]),
        hosts=tuple(str(h) for h in d["hosts"]),
        steps=tuple(int(s) for s in d["steps"]),
        step_time=matrix(d["step_time"]),
        wait=matrix(d["wait"]),
        transfer=matrix(d["transfer"]),
        cpu=matrix(d["cpu"]),
        data_wait=matrix(d["data_wait"]),
        # Absent in a state saved before the run-queue wait: not measured.
        runq=matrix(d.get("runq") or [[None] * n for _ in d["steps"]]),
    )
    links = tuple(
        LinkSample(int(r), int(lo), int(pe), int(b), int(rc), float(busy), int(st))
        for r, lo, pe, b, rc, busy, st in d["links"]
    )
    return _Pool(aligned, links)


def _contention(h: Hit) -> bool:
    """A hit of the ``cpu_contention`` detector: a rank's, or a host's whose ranks were
    late for want of a core."""
    return h.cause == "cpu_contention" or (h.cause == "host" and h.underlying == "cpu_contention")


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
    if x.cause == "cpu_contention":
        return (
            f"it waited {fmt.secs(x.evidence['extra_runq_s'])} per step longer than its peers for a CPU core "
            "(run-queue wait, no extra work): other work competes with it for its host's cores"
        )
    return "no extra CPU or loader wait: the host stalled (a sleep, a slow callback, a pause)"


def _rank_hit(x: LateRank, span: tuple[int, int], sent: tuple[float, float] | None = None) -> Hit:
    """A late rank's hit; with ``sent`` (its bytes and its peers' median in the window)
    a host stall is named for what it did instead: communication on its link."""
    why = _why(x)
    cause: Cause = x.cause
    evidence = _evidence(x)
    if sent is not None:
        cause = "link"
        why = (
            f"no extra CPU, but it sent {sent[0] / 1e6:.1f} MB against its peers' "
            f"{sent[1] / 1e6:.1f} MB: extra communication on its link"
        )
        evidence.update({"sent_mb": sent[0] / 1e6, "peer_sent_mb": sent[1] / 1e6})
    detail = (
        f"its peers waited for it at the gradient all-reduce on {x.late_steps} of {x.steps} steps, "
        f"{fmt.secs(x.lateness_s)} per step ({fmt.pct(x.share)} of the step, sign test p={x.p_value:.3f}); "
        + why
    )
    return Hit(
        key=rank_key(cause, x.rank),
        cause=cause,
        ranks=(x.rank,),
        hosts=(x.host,),
        first_step=span[0],
        last_step=span[1],
        cost_seconds=x.lateness_s,
        step_time_s=x.evidence["step_time_s"],
        evidence=evidence,
        detail=detail,
    )


def _link_peers(links: Sequence[LinkSample], slow: set[int]) -> set[int]:
    """Ranks at the other end of a connection of a slow-linked rank."""
    out: set[int] = set()
    for e in edges(links):
        if e.src in slow:
            out.add(e.dst)
        if e.dst in slow:
            out.add(e.src)
    return out - slow


def _computed_away(link: Hit, late: Sequence[LateRank], links: Sequence[LinkSample]) -> LateRank | None:
    """The compute straggler at the other end of a connection of ``link``'s rank whose
    extra training-thread CPU per step outweighs the time that rank lost on its link, if
    there is one: its extra work, not the link, slowed those connections (module
    docstring). A slow link cannot add more CPU to a peer than the transfer time it costs."""
    near = _link_peers(links, set(link.ranks))
    for x in late:
        extra_cpu = x.evidence.get("extra_cpu_s", 0.0)
        if x.cause == "compute" and x.rank in near and extra_cpu >= link.cost_seconds:
            return x
    return None


def _link_hit(x: SlowLink, host: str, span: tuple[int, int], step_time_s: float) -> Hit:
    detail = (
        f"every connection carrying its data delivered at most {x.rate / 1e6:.1f} MB/s while busy, "
        f"against {x.peer_rate / 1e6:.1f} MB/s on the job's other connections; "
        f"{fmt.secs(x.lost_s)} per step lost on its link ({fmt.pct(x.share)} of the step)"
    )
    return Hit(
        key=rank_key("link", x.rank),
        cause="link",
        ranks=(x.rank,),
        hosts=(host,),
        first_step=span[0],
        last_step=span[1],
        cost_seconds=x.lost_s,
        step_time_s=step_time_s,
        evidence=dict(x.evidence),
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
