"""Wait vs transfer: line up each collective across the ranks of its group (pure).

A collective cannot finish before its last participant arrives (DESIGN §4). For one
collective and one rank, with enter and end times on a common clock:

    wait     = last arrival among the group's ranks - own arrival
    transfer = own end - last arrival          (clamped at 0)

So the rank that arrives last (a compute straggler) waits ~0 and its peers wait for it,
while a slow link shows as long transfer on every rank of the groups it belongs to.

Lining up: a collective is identified across ranks by its group (name and member ranks)
and either the group's sequence number (``key_kind == "seq"``, NCCL) or the step and the
collective's order within the step and group (``"order"``, gloo; every rank of a group
runs the same collectives in the same order). A collective is used only when every
member of its group reported it; otherwise the last arrival is unknown and the
collective gives no wait/transfer at all (rather than a wrong one).

Clocks: each rank's times are shifted by its measured offset to rank 0's clock (0 for
ranks on rank 0's host or whose offset is unknown).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["GroupArrivals", "RankSkew", "split_wait_transfer"]


#: A process group across ranks: its name and its members (``None`` when not listed).
GroupId = tuple[str, tuple[int, ...] | None]


@dataclass(frozen=True)
class GroupArrivals:
    """One rank's collectives of one group in one profiler window, times in seconds
    on this rank's clock (absolute: ``t0`` already added)."""

    group: str
    ranks: tuple[int, ...] | None
    size: int | None
    key_kind: str
    step: Sequence[int]
    op: Sequence[str]
    key: Sequence[int]
    enter: Sequence[float]
    end: Sequence[float]


@dataclass
class RankSkew:
    """What one rank waited and transferred: per step sums, and per op the samples."""

    #: step -> [wait sum, transfer sum, collectives]
    steps: dict[int, list[float]] = field(default_factory=dict)
    #: op -> (waits, transfers), one value per collective
    ops: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)
    #: (step, group members or None) -> transfer sum: which link was slow
    groups: dict[tuple[int, tuple[int, ...] | None], float] = field(default_factory=dict)


def split_wait_transfer(
    arrivals: Mapping[int, Sequence[GroupArrivals]],
    *,
    world_size: int,
    offsets: Mapping[int, float] | None = None,
) -> dict[int, RankSkew]:
    """Wait and transfer of every complete collective, per rank (see the module docstring).

    ``arrivals`` maps rank -> its groups. A group without a member list is taken to be
    ``size`` ranks (or the whole world) and is complete when that many ranks reported it.
    """
    offsets = offsets or {}
    # (group id, collective id) -> [(rank, op, step, enter, end)]
    table: dict[tuple[GroupId, object], list[tuple[int, str, int, float, float]]] = {}
    expected: dict[GroupId, int] = {}
    for rank, groups in arrivals.items():
        shift = offsets.get(rank, 0.0)
        for g in groups:
            gid: GroupId = (g.group, g.ranks)
            expected[gid] = len(g.ranks) if g.ranks else (g.size or world_size)
            for i in range(len(g.step)):
                cid: object = g.key[i] if g.key_kind == "seq" else (g.step[i], g.key[i])
                table.setdefault((gid, cid), []).append(
                    (rank, g.op[i], g.step[i], g.enter[i] + shift, g.end[i] + shift)
                )
    out: dict[int, RankSkew] = {}
    for (group_id, _), rows in table.items():
        if len({r[0] for r in rows}) != expected[group_id] or len(rows) != expected[group_id]:
            continue
        last = max(r[3] for r in rows)
        for rank, op, step, enter, end in rows:
            wait = last - enter
            transfer = max(0.0, end - last)
            skew = out.setdefault(rank, RankSkew())
            acc = skew.steps.setdefault(step, [0.0, 0.0, 0.0])
            acc[0] += wait
            acc[1] += transfer
            acc[2] += 1
            waits, transfers = skew.ops.setdefault(op, ([], []))
            waits.append(wait)
            transfers.append(transfer)
            key = (step, group_id[1])
            skew.groups[key] = skew.groups.get(key, 0.0) + transfer
    return out
