"""Which rank's link is slow, and which rank moves more bytes than its peers, from the
per-connection link timing (the agent's ``comm.links``: ``stepwatch._links``).

Why not from the collective timing: a ring all-reduce moves at the pace of its slowest
link, so every rank of the group sees the same longer transfer. Measured on 4 real gloo
ranks in network namespaces with one rank's veth limited by ``tc tbf``: the ranks' sync,
arrival and all-reduce durations differed by a few milliseconds, in an order set by
their places in the ring, and no rank stood out. The links do: bytes acknowledged over
the time the connection was busy with data in flight is the rate it delivered while it
had work (150 Mbit/s shaped: 15-16 MB/s; the unshaped veths 70-130 MB/s on the same
loaded host).

Localisation is the intersection of design brief §4 done on connections: a slow link (a
NIC, a cable, a shaped veth) slows every connection that carries the rank's data, in
*and* out, while each of its peers has only one slow connection (the one to it). So a
rank is named when every data-carrying connection it has, in both directions, is at
least ``slow_ratio`` times slower than the median of the connections it is not on that
carry about as many bytes per step (the same collective's traffic: a rate measured on
small messages is bound by latency; on loopback the 4 MB all-reduces of a side group
were 5-10x "faster" than the 50 KB gradient buckets of the same ranks), and the time
lost (its connections' busy time beyond what the others' rate needs) is at least
``min_share`` of the step. A one-way slow connection alone names nobody: either end
could be at fault.

Extra communication (:func:`extra_bytes`): a rank that sent much more than its peers'
median (leave-one-out) spent the difference on its link; the late-arrival detector
names such a late rank ``link`` rather than ``host_stall`` (no extra CPU, but bytes).

Pure functions over plain data.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class LinkSample:
    """One connection of one rank over one window (summed over the window's batches)."""

    rank: int
    local: int  # endpoint id of this end
    peer: int  # endpoint id of the other end
    bytes_sent: int
    bytes_received: int
    busy_s: float
    steps: int = 1  # steps of the batches summed


@dataclass(frozen=True, slots=True)
class Edge:
    """A connection by direction of its data: ``src`` sent ``bytes`` to ``dst`` over
    ``steps`` steps."""

    src: int
    dst: int
    bytes: int
    busy_s: float
    steps: int = 1

    @property
    def per_step(self) -> float:
        return self.bytes / max(1, self.steps)

    @property
    def rate(self) -> float:
        """Bytes per busy second (infinite when the kernel counted no busy time)."""
        return self.bytes / self.busy_s if self.busy_s > 0 else math.inf


@dataclass(frozen=True, slots=True)
class LinkConfig:
    #: A connection carries the job's data when it moved at least this share of the
    #: busiest connection's bytes in the window (small ones: ACK traffic, the store).
    data_share: float = 0.1
    #: ... and at least this many bytes (rates of tiny transfers are latency, not speed).
    min_bytes: int = 1 << 20
    #: A data connection is slow at this many times below the median rate of the
    #: connections it is compared with: those the rank is not on that moved about as
    #: many bytes per step (within ``like_bytes``: the same collective's traffic; the
    #: rate of small messages is bound by latency, so a 4 MB all-reduce and 50 KB
    #: gradient buckets are not compared).
    slow_ratio: float = 3.0
    like_bytes: float = 1.25
    #: Busy time lost on its slowest connection, per step, as a share of the step.
    min_share: float = 0.05
    #: Bytes sent beyond the peers' median, as a share of it, that make a late rank's
    #: lateness communication.
    extra_bytes: float = 0.5


@dataclass(frozen=True, slots=True)
class SlowLink:
    rank: int
    rate: float  # bytes/s of its fastest data connection
    peer_rate: float  # median bytes/s of the data connections it is not on
    lost_s: float  # per step: busy time beyond what the peers' rate needs
    share: float  # lost_s over the step time
    evidence: Mapping[str, float] = field(default_factory=dict)


def merge(samples: Sequence[LinkSample]) -> list[LinkSample]:
    """One sample per (rank, connection): a window's batches summed."""
    acc: dict[tuple[int, int, int], list[float]] = {}
    for s in samples:
        a = acc.setdefault((s.rank, s.local, s.peer), [0, 0, 0.0, 0])
        a[0] += s.bytes_sent
        a[1] += s.bytes_received
        a[2] += s.busy_s
        a[3] += s.steps
    return [
        LinkSample(r, lo, pe, int(a[0]), int(a[1]), float(a[2]), int(a[3]))
        for (r, lo, pe), a in sorted(acc.items())
    ]


def edges(samples: Sequence[LinkSample]) -> list[Edge]:
    """Directed connections between ranks: each sample's sent bytes, its peer's rank
    found by the peer's own sample of the same connection (a connection whose other
    end reported nothing is left out)."""
    owner = {s.local: s.rank for s in samples}
    out = []
    for s in samples:
        dst = owner.get(s.peer)
        if dst is not None and dst != s.rank and s.bytes_sent > 0:
            out.append(Edge(s.rank, dst, s.bytes_sent, s.busy_s, s.steps))
    return out


def slow_links(
    samples: Sequence[LinkSample], *, step_time_s: float, cfg: LinkConfig = LinkConfig()
) -> list[SlowLink]:
    """Ranks whose link is slow in this window (see the module docstring); the lost time
    is per step of the batches sampled, ``step_time_s`` (the median step) makes it a
    share."""
    all_edges = edges(merge(samples))
    if not all_edges or step_time_s <= 0:
        return []
    floor = max(cfg.min_bytes, cfg.data_share * max(e.bytes for e in all_edges))
    data = [e for e in all_edges if e.bytes >= floor]
    out = []
    for c in sorted({r for e in data for r in (e.src, e.dst)}):
        others = [e for e in data if c not in (e.src, e.dst)]
        # Each of its data connections against the like ones it is not on.
        judged: list[tuple[Edge, float, int]] = []
        for e in (e for e in data if c in (e.src, e.dst)):
            like = [o.rate for o in others if _like(o.per_step, e.per_step, cfg.like_bytes)]
            ref = statistics.median(like) if like else math.nan
            if math.isfinite(ref):
                judged.append((e, ref, len(like)))
        if not judged or any(e.rate * cfg.slow_ratio > ref for e, ref, _ in judged):
            continue  # nothing to compare, or one of its connections is not slow
        if not any(e.src == c for e, _, _ in judged) or not any(e.dst == c for e, _, _ in judged):
            continue  # slow one way only: either end could be at fault
        lost = max((e.busy_s - e.bytes / ref) / max(1, e.steps) for e, ref, _ in judged)
        share = lost / step_time_s
        if share < cfg.min_share:
            continue
        fastest, ref = max(((e.rate, r) for e, r, _ in judged), key=lambda x: x[0])
        out.append(
            SlowLink(
                rank=c,
                rate=fastest,
                peer_rate=ref,
                lost_s=lost,
                share=share,
                evidence={
                    "rate_mb_s": fastest / 1e6,
                    "peer_rate_mb_s": ref / 1e6,
                    "lost_s": lost,
                    "connections": float(len(judged)),
                    "compared_with": float(min(n for _, _, n in judged)),
                    "sent_mb": sum(e.bytes for e, _, _ in judged if e.src == c) / 1e6,
                },
            )
        )
    return out


def _like(a: float, b: float, factor: float) -> bool:
    return a > 0 and b > 0 and max(a, b) <= factor * min(a, b)


def extra_bytes(
    samples: Sequence[LinkSample], cfg: LinkConfig = LinkConfig()
) -> dict[int, tuple[float, float]]:
    """Ranks that sent at least ``1 + extra_bytes`` times their peers' median (leave one
    out) in the window: rank -> (its bytes, the peers' median).

    The leave-one-out medians come from one sort (:func:`_medians_without_each`): a
    median of the others per rank was O(ranks^2), 30% of a window pass at 4,096 ranks."""
    sent: dict[int, int] = {}
    for s in samples:
        sent[s.rank] = sent.get(s.rank, 0) + s.bytes_sent
    if len(sent) < 2:
        return {}
    out = {}
    for r, peers in _medians_without_each(sent).items():
        b = sent[r]
        if peers > 0 and b >= (1 + cfg.extra_bytes) * peers and b - peers >= cfg.min_bytes:
            out[r] = (float(b), float(peers))
    return out


def _medians_without_each(values: Mapping[int, float]) -> dict[int, float]:
    """For each key, the median of the other keys' values (at least two keys), as
    ``statistics.median`` gives it, from one sort: leaving out the value at sorted
    position ``i`` shifts the positions after it down by one."""
    order = sorted(values, key=values.__getitem__)
    v = [values[k] for k in order]
    m = len(v) - 1  # values left

    def at(k: int, i: int) -> float:  # position k of the sorted values without position i
        return v[k] if k < i else v[k + 1]

    if m % 2:
        return {key: at(m // 2, i) for i, key in enumerate(order)}
    return {key: (at(m // 2 - 1, i) + at(m // 2, i)) / 2 for i, key in enumerate(order)}
