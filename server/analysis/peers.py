"""Straggler evidence in ONE window: which ranks are slow among their peers, and why.

This module is stateless; :mod:`.stragglers` adds persistence and hysteresis on top.

Physics (design brief §4). In synchronous training a collective ends when its slowest
member arrives, so every rank's *step time* is nearly the same: the culprit computes
longer and waits less, its victims wait longer. Raw step time or raw collective time
therefore never names a compute straggler; only compute time (confirmed by a low
collective wait) does. Consequences for the causes:

``compute``
    compute time is an outlier among the peers *and*, when ``comm_wait_s`` is known, the
    rank waits no longer than the median peer (it is the one the others wait for). Needs
    the profiler fields: without ``compute_s`` in a window, compute stragglers are simply
    not evaluated in it (neither flagged nor cleared).
``data``
    data-loader wait is an outlier. ``data_wait_s`` is always measured, so data
    stragglers are the one cause detectable without the profiler.
``link``
    compute is normal but transfer is long. With communicator groups
    (``RankWindow.groups`` / ``group_transfer_s``): a group is slow when its transfer
    time is an outlier among the groups of the same type (all DP rings, all TP
    groups, ...); the other members of a slow group are slow in that group only, so a
    rank is named when its slow groups span at least two types: the intersection of the
    slow groups. (Not *every* group of the rank need be slow: a small transfer, such as
    pipeline send/recv of activations, can stay below the noise floor.) A type is usable
    when at least ``min_groups`` groups of it report. Without group data the rank's own
    ``comm_transfer_s`` is compared with its peers' (an agent measuring its own sends).
    Two simultaneous slow links can also name a rank sharing one group with each; the
    evidence (per-type transfer numbers) shows it. A slow NIC shared by a host's ranks
    slows many groups of one type at once and is found, if at all, as a host flag.
``host``
    one host flag replaces the per-rank flags of a host (a throttled node, a noisy host
    process) when, in the same window, at least ``host_min_ranks`` (2) of its ranks and
    ``host_fraction`` (75%) of those present are flagged (any cause), or when its ranks
    taken together pass the thresholds: the medians over the host's ranks of their
    compute (or data-wait) ratio and z pass ``min_ratio`` and ``min_z``, and the host's
    median ratio is an outlier among hosts. The joint test holds steady when single ranks
    hover at the per-rank threshold.

Peers are the ranks with the same (pipeline stage, tensor rank, context rank): pipeline
stages differ by design, so a uniformly slower stage is never a straggler (it is an
efficiency finding, see :mod:`.efficiency`). Without a layout all ranks are peers.

A rank is an outlier on a quantity x when ``x / median >= min_ratio`` (1.10) and the robust
z ``(x - median) / scale >= min_z`` (5), with ``scale = max(1.4826 MAD, 1% of the median,
0.5% of the job's median step time, 1 ms)``, and the rank costs at least
``min_cost_ratio`` (1%) of step time. The ratio keeps tiny but consistent differences
among very quiet peers from flagging; the z keeps a 10% difference among noisy peers from
flagging. The step-relative floor matters for data-loader wait, whose median is near zero:
one 0.8 s loader stall in a 20-step window lifts that window's mean by 40 ms, and with a
2 s step the floor (10 ms) keeps such a window below z = 5, so the data-straggler floor is
about 2.5% of step time (measured: 0 false flags over 512,000 clean rank-windows of the
tuning generator, and over the 148,480 clean rank-windows of the simulator's timing model
that ``stepwatch evaluate`` runs). Slow communicator groups are compared with the 1 ms floor only: they
localise a link, and the cost floor decides whether it matters. The peer statistics
include the rank itself: the median and MAD are robust to it, and leaving it out would
cost one sort per rank.

Cost (the what-if): how much shorter the step would be if the rank ran at its peers'
median. For compute and data: the rank's local work (compute + data wait, or data wait
alone without the profiler) minus the peer median of the same, floored at zero. For a
link: the excess transfer of its slow groups over their type medians, summed. For a
host: the largest cost among its flagged ranks (the step waits for the slowest one).
Each is an upper bound when several ranks are slow at once. ``cost_ratio`` divides by the
job's median step time in the window.

Why one module of more than 400 lines: the causes are judged in one pass over the
window's ranks (a compute verdict needs the same rank's wait, a link verdict its
compute), and the physics above is written next to the code that applies it.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, cast

from . import _format as fmt
from .robust import RobustStats, median, robust_stats
from .types import Cause, RankWindow


@dataclass(frozen=True, slots=True)
class StragglerConfig:
    """Thresholds of the straggler detector; the defaults are the issue's.

    ``open_after`` consecutive flagged windows open a flag, ``close_after`` consecutive
    clean windows close it (hysteresis). ``min_peers`` is the smallest peer group (or,
    ``min_groups``, number of groups of one type) that robust statistics are computed on.
    """

    min_ratio: float = 1.10
    min_z: float = 5.0
    open_after: int = 3
    close_after: int = 3
    min_peers: int = 4
    min_groups: int = 3
    rel_scale_floor: float = 0.01
    abs_scale_floor_s: float = 0.001
    step_scale_floor: float = 0.005
    min_cost_ratio: float = 0.01
    host_min_ranks: int = 2
    host_fraction: float = 0.75

    def __post_init__(self) -> None:
        if self.open_after < 1 or self.close_after < 1:
            raise ValueError("open_after and close_after must be >= 1")
        if self.min_peers < 3 or self.min_groups < 3:
            raise ValueError("min_peers and min_groups must be >= 3 for a median and MAD to mean anything")
        if self.abs_scale_floor_s <= 0.0:
            raise ValueError("abs_scale_floor_s must be > 0")
        if not 0.0 < self.host_fraction <= 1.0 or self.host_min_ranks < 2:
            raise ValueError("host_fraction must be in (0, 1] and host_min_ranks >= 2")

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the thresholds."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StragglerConfig:
        """Inverse of :meth:`to_dict`; unknown keys are ignored, missing ones default."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True, slots=True)
class Hit:
    """One rank (or host) flagged in one window, with the numbers that flagged it."""

    key: str
    cause: Cause
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]
    first_step: int
    last_step: int
    cost_seconds: float
    step_time_s: float
    evidence: Mapping[str, float]
    detail: str
    underlying: Cause | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "key": self.key,
            "cause": self.cause,
            "ranks": list(self.ranks),
            "hosts": list(self.hosts),
            "first_step": self.first_step,
            "last_step": self.last_step,
            "cost_seconds": self.cost_seconds,
            "step_time_s": self.step_time_s,
            "evidence": dict(self.evidence),
            "detail": self.detail,
            "underlying": self.underlying,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Hit:
        """Inverse of :meth:`to_dict`."""
        return cls(
            key=str(data["key"]),
            cause=cast(Cause, data["cause"]),
            ranks=tuple(int(r) for r in data["ranks"]),
            hosts=tuple(str(h) for h in data["hosts"]),
            first_step=int(data["first_step"]),
            last_step=int(data["last_step"]),
            cost_seconds=float(data["cost_seconds"]),
            step_time_s=float(data["step_time_s"]),
            evidence={str(k): float(v) for k, v in dict(data["evidence"]).items()},
            detail=str(data["detail"]),
            underlying=cast("Cause | None", data.get("underlying")),
        )


@dataclass(frozen=True, slots=True)
class WindowVerdict:
    """What one window says: the hits, and which keys it had data for.

    A key absent from ``hits`` but present in ``observed`` is a clean window for that key;
    a key in neither carries no information (e.g. no profiler data for a compute key).
    """

    window: int
    first_step: int
    last_step: int
    hits: Mapping[str, Hit]
    observed: frozenset[str] = field(default_factory=frozenset)


def rank_key(cause: Cause, rank: int) -> str:
    """Stable key of a per-rank straggler flag."""
    return f"straggler:{cause}:rank={rank}"


def host_key(host: str) -> str:
    """Stable key of a host straggler flag."""
    return f"straggler:host:host={host}"


#: Per cause, rank -> (ratio to the peer median, robust z, cost in seconds), for the host test.
_Scores = dict[str, dict[int, tuple[float, float, float]]]

_NOUN: dict[str, str] = {"compute": "compute time", "data": "data-loader wait"}

_CAUSE_PHRASE: dict[str, str] = {
    "compute": "compute stragglers",
    "data": "data stragglers",
    "link": "on slow links",
}


def evaluate_window(windows: Sequence[RankWindow], config: StragglerConfig | None = None) -> WindowVerdict:
    """Flag the ranks (and hosts) that are outliers among their peers in one window.

    All ``windows`` must carry the same window index (one per rank). Pure function.
    """
    cfg = config or StragglerConfig()
    if not windows:
        raise ValueError("evaluate_window needs at least one rank window")
    index = windows[0].window
    if any(w.window != index for w in windows):
        raise ValueError("evaluate_window needs windows of a single index")
    step_ref = median([w.step_time_s for w in windows])
    rank_hits: dict[int, list[Hit]] = defaultdict(list)
    observed: set[str] = set()

    peers: dict[tuple[int | None, int | None, int | None], list[RankWindow]] = defaultdict(list)
    for w in windows:
        peers[w.peer_key].append(w)
    compute_hit: set[int] = set()
    scores: _Scores = defaultdict(dict)
    for group in peers.values():
        _evaluate_peers(group, cfg, step_ref, rank_hits, scores, observed, compute_hit)
    _evaluate_groups(windows, cfg, step_ref, rank_hits, observed, compute_hit)
    hits = _aggregate_hosts(windows, cfg, step_ref, rank_hits, scores, observed)
    return WindowVerdict(
        window=index,
        first_step=min(w.first_step for w in windows),
        last_step=max(w.last_step for w in windows),
        hits=hits,
        observed=frozenset(observed),
    )


def _floor(cfg: StragglerConfig, step_ref: float) -> float:
    """Absolute scale floor in seconds: differences below it are never significant."""
    return max(cfg.abs_scale_floor_s, cfg.step_scale_floor * step_ref)


def _stats(values: Sequence[float], cfg: StragglerConfig, floor: float) -> RobustStats:
    return robust_stats(values, rel_floor=cfg.rel_scale_floor, abs_floor=floor)


def _outlier(x: float, stats: RobustStats, cfg: StragglerConfig, floor: float) -> tuple[bool, float, float]:
    ratio = stats.ratio(x, floor)
    z = stats.z(x)
    return ratio >= cfg.min_ratio and z >= cfg.min_z, ratio, z


def _evaluate_peers(
    group: Sequence[RankWindow],
    cfg: StragglerConfig,
    step_ref: float,
    rank_hits: dict[int, list[Hit]],
    scores: _Scores,
    observed: set[str],
    compute_hit: set[int],
) -> None:
    """Compute and data outliers (and per-rank transfer without group data) in one peer group."""
    if len(group) < cfg.min_peers:
        return
    floor = _floor(cfg, step_ref)
    n = float(len(group))
    data = _stats([w.data_wait_s for w in group], cfg, floor)
    with_c = [w for w in group if w.compute_s is not None]
    compute = local = None
    wait_median: float | None = None
    if len(with_c) >= cfg.min_peers:
        compute = _stats([cast(float, w.compute_s) for w in with_c], cfg, floor)
        local = _stats([cast(float, w.compute_s) + w.data_wait_s for w in with_c], cfg, floor)
        waits = [w.comm_wait_s for w in with_c if w.comm_wait_s is not None]
        if len(waits) >= cfg.min_peers:
            wait_median = median(waits)

    for w in group:
        if local is not None and w.compute_s is not None:
            cost = max(0.0, w.compute_s + w.data_wait_s - local.median)
        else:
            cost = max(0.0, w.data_wait_s - data.median)
        cost_ratio = cost / step_ref if step_ref > 0 else 0.0

        observed.add(rank_key("data", w.rank))
        flagged, ratio, z = _outlier(w.data_wait_s, data, cfg, floor)
        scores["data"][w.rank] = (ratio, z, cost)
        if flagged and cost_ratio >= cfg.min_cost_ratio:
            rank_hits[w.rank].append(
                _rank_hit(
                    w,
                    "data",
                    cost,
                    step_ref,
                    {
                        "data_wait_s": w.data_wait_s,
                        "peer_median_data_wait_s": data.median,
                        "ratio": ratio,
                        "z": z,
                        "peers": n,
                    },
                    f"data-loader wait {fmt.secs(w.data_wait_s)} vs peer median {fmt.secs(data.median)}",
                )
            )

        if compute is None or w.compute_s is None:
            continue
        observed.add(rank_key("compute", w.rank))
        flagged, ratio, z = _outlier(w.compute_s, compute, cfg, floor)
        scores["compute"][w.rank] = (ratio, z, cost)
        # The culprit is the one the others wait for: its own wait is not above the median.
        confirmed = w.comm_wait_s is None or wait_median is None or w.comm_wait_s <= wait_median
        if flagged and confirmed and cost_ratio >= cfg.min_cost_ratio:
            compute_hit.add(w.rank)
            evidence = {
                "compute_s": w.compute_s,
                "peer_median_compute_s": compute.median,
                "ratio": ratio,
                "z": z,
                "peers": n,
            }
            detail = f"compute {fmt.secs(w.compute_s)} vs peer median {fmt.secs(compute.median)}"
            if w.comm_wait_s is not None and wait_median is not None:
                evidence["comm_wait_s"] = w.comm_wait_s
                evidence["peer_median_comm_wait_s"] = wait_median
                detail += f", collective wait {fmt.secs(w.comm_wait_s)} vs {fmt.secs(wait_median)}"
            rank_hits[w.rank].append(_rank_hit(w, "compute", cost, step_ref, evidence, detail))

    # Per-rank transfer only for ranks that report no group data (see module docstring).
    with_t = [w for w in group if w.comm_transfer_s is not None and not w.group_transfer_s]
    if len(with_t) < cfg.min_peers:
        return
    transfer = _stats([cast(float, w.comm_transfer_s) for w in with_t], cfg, floor)
    for w in with_t:
        observed.add(rank_key("link", w.rank))
        x = cast(float, w.comm_transfer_s)
        flagged, ratio, z = _outlier(x, transfer, cfg, floor)
        cost = max(0.0, x - transfer.median)
        if flagged and w.rank not in compute_hit and cost >= cfg.min_cost_ratio * step_ref:
            rank_hits[w.rank].append(
                _rank_hit(
                    w,
                    "link",
                    cost,
                    step_ref,
                    {
                        "transfer_s": x,
                        "peer_median_transfer_s": transfer.median,
                        "ratio": ratio,
                        "z": z,
                        "peers": n,
                    },
                    f"transfer {fmt.secs(x)} vs peer median {fmt.secs(transfer.median)}",
                )
            )


def _evaluate_groups(
    windows: Sequence[RankWindow],
    cfg: StragglerConfig,
    step_ref: float,
    rank_hits: dict[int, list[Hit]],
    observed: set[str],
    compute_hit: set[int],
) -> None:
    """Slow communicator groups, intersected to name the rank on the slow link."""
    reported: dict[tuple[str, str], list[float]] = defaultdict(list)
    for w in windows:
        for gtype, gid in w.groups.items():
            value = w.group_transfer_s.get(gtype)
            if value is not None:
                reported[(gtype, gid)].append(value)
    if not reported:
        return
    # Slow groups localise the link; whether it matters is the cost floor's job below, so
    # groups are compared without the step-relative floor (a slow TP group moves little).
    floor = cfg.abs_scale_floor_s
    by_type: dict[str, dict[str, float]] = defaultdict(dict)
    for (gtype, gid), values in reported.items():
        by_type[gtype][gid] = median(values)
    type_median: dict[str, float] = {}
    slow: dict[tuple[str, str], tuple[float, float]] = {}
    for gtype, per_group in by_type.items():
        if len(per_group) < cfg.min_groups:
            continue
        stats = _stats(list(per_group.values()), cfg, floor)
        type_median[gtype] = stats.median
        for gid, value in per_group.items():
            if _outlier(value, stats, cfg, floor)[0]:
                slow[(gtype, gid)] = (value, stats.median)

    for w in windows:
        usable = [(t, g) for t, g in sorted(w.groups.items()) if t in type_median and (t, g) in reported]
        if len(usable) < 2:
            continue
        observed.add(rank_key("link", w.rank))
        slow_here = [u for u in usable if u in slow]
        if w.rank in compute_hit or len(slow_here) < 2:
            continue
        cost = sum(slow[u][0] - slow[u][1] for u in slow_here)
        if cost < cfg.min_cost_ratio * step_ref:
            continue
        evidence: dict[str, float] = {"slow_groups": float(len(slow_here)), "groups": float(len(usable))}
        parts = []
        for gtype, gid in slow_here:
            value, med = slow[(gtype, gid)]
            evidence[f"transfer_{gtype}_s"] = value
            evidence[f"median_transfer_{gtype}_s"] = med
            parts.append(f"{gtype} {fmt.secs(value)} vs median {fmt.secs(med)}")
        detail = "transfer " + ", ".join(parts) + f" in {len(slow_here)} of its {len(usable)} groups"
        rank_hits[w.rank] = [h for h in rank_hits[w.rank] if h.cause != "link"]
        rank_hits[w.rank].append(_rank_hit(w, "link", cost, step_ref, evidence, detail))


def _aggregate_hosts(
    windows: Sequence[RankWindow],
    cfg: StragglerConfig,
    step_ref: float,
    rank_hits: dict[int, list[Hit]],
    scores: _Scores,
    observed: set[str],
) -> dict[str, Hit]:
    """Replace per-rank hits by one host hit when a host's ranks are slow together.

    Two ways in: most local ranks are flagged individually, or the host's ranks taken
    together are an outlier among hosts (the median of their ratios to their peers),
    which holds steady when single ranks hover around the per-rank threshold.
    """
    ranks_by_host: dict[str, set[int]] = defaultdict(set)
    steps: dict[str, tuple[int, int]] = {}
    for w in windows:
        ranks_by_host[w.host].add(w.rank)
        lo, hi = steps.get(w.host, (w.first_step, w.last_step))
        steps[w.host] = (min(lo, w.first_step), max(hi, w.last_step))
    together = _host_outliers(ranks_by_host, scores, cfg, step_ref)
    out: dict[str, Hit] = {}
    for host, ranks in sorted(ranks_by_host.items()):
        observed.add(host_key(host))
        flagged = sorted(r for r in ranks if rank_hits.get(r))
        need = max(cfg.host_min_ranks, math.ceil(cfg.host_fraction * len(ranks) - 1e-9))
        joint = together.get(host)
        if len(flagged) < need and joint is None:
            continue
        all_hits = [h for r in sorted(ranks) for h in rank_hits.pop(r, [])]
        worst = max(all_hits, key=lambda h: h.cost_seconds, default=None)
        evidence = {"flagged_ranks": float(len(flagged)), "local_ranks": float(len(ranks))}
        if joint is not None:
            underlying, ratio, z, cost = joint
            evidence.update({"host_median_ratio": ratio, "host_z": z})
            detail = (
                f"its {len(ranks)} local ranks' median {_NOUN[underlying]} is "
                f"{fmt.pct(ratio - 1.0)} above their peers' ({len(flagged)} flagged singly)"
            )
        else:
            underlying = Counter(h.cause for h in all_hits).most_common(1)[0][0]
            cost = 0.0
            detail = f"{len(flagged)} of {len(ranks)} local ranks are {_CAUSE_PHRASE[underlying]}"
        if worst is not None:
            cost = max(cost, worst.cost_seconds)
            evidence["worst_rank"] = float(worst.ranks[0])
            evidence.update({f"worst_{k}": v for k, v in worst.evidence.items()})
            detail += f" (worst: rank {worst.ranks[0]}, {worst.detail})"
        evidence["cost_s"] = cost
        evidence["step_time_s"] = step_ref
        out[host_key(host)] = Hit(
            key=host_key(host),
            cause="host",
            ranks=tuple(sorted(ranks)) if joint is not None else tuple(flagged),
            hosts=(host,),
            first_step=steps[host][0],
            last_step=steps[host][1],
            cost_seconds=cost,
            step_time_s=step_ref,
            evidence=evidence,
            detail=detail,
            underlying=underlying,
        )
    for hits in rank_hits.values():
        for h in hits:
            out[h.key] = h
    return out


def _host_outliers(
    ranks_by_host: Mapping[str, set[int]], scores: _Scores, cfg: StragglerConfig, step_ref: float
) -> dict[str, tuple[Cause, float, float, float]]:
    """Hosts whose ranks, by their medians, pass the per-rank thresholds and stand out.

    A host qualifies for a cause when the median over its ranks of the ratio to the peer
    median is at least ``min_ratio``, the median of their robust z at least ``min_z``, and
    its median ratio is itself an outlier (z >= ``min_z``) among the hosts' medians.
    Returns host -> (cause, median ratio, z among hosts, largest rank cost).
    """
    out: dict[str, tuple[Cause, float, float, float]] = {}
    causes: tuple[Cause, ...] = ("compute", "data")
    for cause in causes:
        per_rank = scores.get(cause, {})
        ratios: dict[str, float] = {}
        zs: dict[str, float] = {}
        costs: dict[str, float] = {}
        for host, ranks in ranks_by_host.items():
            vals = [per_rank[r] for r in ranks if r in per_rank]
            if len(vals) >= cfg.host_min_ranks and len(vals) >= cfg.host_fraction * len(ranks):
                ratios[host] = median([v[0] for v in vals])
                zs[host] = median([v[1] for v in vals])
                costs[host] = max(v[2] for v in vals)
        if len(ratios) < cfg.min_groups:
            continue
        stats = robust_stats(list(ratios.values()), rel_floor=cfg.rel_scale_floor, abs_floor=1e-3)
        for host, ratio in ratios.items():
            z = stats.z(ratio)
            if (
                host not in out
                and ratio >= cfg.min_ratio
                and zs[host] >= cfg.min_z
                and z >= cfg.min_z
                and costs[host] >= cfg.min_cost_ratio * step_ref
            ):
                out[host] = (cause, ratio, z, costs[host])
    return out


def _rank_hit(
    w: RankWindow, cause: Cause, cost: float, step_ref: float, evidence: dict[str, float], detail: str
) -> Hit:
    evidence = dict(evidence)
    evidence["cost_s"] = cost
    evidence["step_time_s"] = step_ref
    return Hit(
        key=rank_key(cause, w.rank),
        cause=cause,
        ranks=(w.rank,),
        hosts=(w.host,),
        first_step=w.first_step,
        last_step=w.last_step,
        cost_seconds=cost,
        step_time_s=step_ref,
        evidence=evidence,
        detail=detail,
    )
