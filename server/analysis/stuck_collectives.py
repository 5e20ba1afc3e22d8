"""Which collective a stopped run is stuck in, from each rank's sequence counters.

Every rank's agent counts, per process group, the collectives it entered and completed
(the communication hook, and DDP's buffer broadcast before each forward), with the op and
entry time of the one it is in, and keeps sending them while its training thread is
blocked (heartbeats). In a group whose members all stopped:

- the stuck collective ``N`` is the oldest one a rank waits in: the least of
  ``completed + 1`` over the ranks with a collective in flight (``entered > completed``);
- the members with ``entered < N`` never entered it: they hold the others up (a rank
  hung outside any collective, sleeping in forward, or calling a different one);
- the members with ``entered >= N`` that did not complete it wait in it, since the time
  they entered it; those that completed it went past it. An all-reduce completes on no
  rank until every member entered it, but a broadcast completes on a rank once the data
  reached it: with a peer hung before its forward, the ranks that got rank 0's buffers
  go on to the next all-reduce while the others wait in the broadcast. Taking
  ``max(completed) + 1`` there would name the ranks still in the broadcast as never
  having entered that all-reduce, beside the hung one.

No member missing means every rank waits inside the collective: the fault is below the
ranks (a transport, a link). The counters of a rank with ``entered >= N`` count only when
they came with a heartbeat read after the rank had finished no step for half the hang
threshold (five median steps by default): a window's counters were read while it still
stepped, and a heartbeat's of a rank that is only slow (windows a send interval and a
step apart) may show a collective it is about to leave. A missing rank's counters are
used as they are: a stale one can only be lower than its truth, and a rank that stopped
before a collective its peers wait in has the lower count in any case; the diagnosis says
which missing ranks are unconfirmed: no heartbeat (their process may be stuck with the
interpreter held) or a count below what the others completed (they took part in those
collectives, so the count is older than the rank).

Pure functions over plain data, as the rest of ``analysis``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from . import _format as fmt

#: The default process group's name as the agent reports it: every rank is a member.
WORLD = "world"
#: A point-to-point sequence's name ends with the pair of ranks it is between.
P2P = re.compile(r":p2p:(\d+)-(\d+)$")
#: Collectives that complete on a rank before every member entered them (a broadcast's
#: receiver once the data reached it, a gather's sender once its part left): a rank may
#: go past one its peers still wait in. An all-reduce, all-gather, reduce-scatter,
#: all-to-all or barrier completes on no rank until all entered it.
ONE_SIDED = frozenset({"broadcast", "reduce", "gather", "scatter", "send", "recv", "send_recv"})


@dataclass(frozen=True, slots=True)
class GroupCounters:
    """One rank's latest counters in one process group (a ``rank_groups`` row)."""

    rank: int
    group: str
    entered: int
    completed: int
    op: str | None = None
    #: Unix seconds at which the rank entered the collective ``op`` describes.
    since: float | None = None
    #: Sent with a heartbeat: read while the rank had closed no window for a while.
    heartbeat: bool = True
    #: The heartbeat's seconds since the rank's last step ended, when they were read.
    idle_s: float = 0.0

    def stopped(self, min_idle_s: float) -> bool:
        """Read while the rank had finished no step for ``min_idle_s``: where it stopped."""
        return self.heartbeat and self.idle_s >= min_idle_s


@dataclass(frozen=True, slots=True)
class StuckCollective:
    """The collective a group stopped in, who never entered it and who waits in it."""

    group: str
    op: str | None
    seq: int
    never_entered: tuple[int, ...]
    waiting: tuple[int, ...]
    #: Unix seconds: the earliest entry among the waiting ranks (None: not reported).
    since: float | None
    #: Ranks among ``never_entered`` whose counters came with no heartbeat.
    unconfirmed: tuple[int, ...] = ()
    #: Ranks that completed it (a broadcast's receivers) and wait in a later one.
    went_past: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The event's ``evidence.collective``: JSON-ready."""
        return {
            "group": self.group,
            "op": self.op,
            "seq": self.seq,
            "never_entered": list(self.never_entered),
            "waiting": list(self.waiting),
            "since": self.since,
            "unconfirmed": list(self.unconfirmed),
            "went_past": list(self.went_past),
        }

    @classmethod
    def from_dict(cls, data: Any) -> StuckCollective:
        return cls(
            group=str(data["group"]),
            op=None if data.get("op") is None else str(data["op"]),
            seq=int(data["seq"]),
            never_entered=tuple(int(r) for r in data.get("never_entered", ())),
            waiting=tuple(int(r) for r in data.get("waiting", ())),
            since=None if data.get("since") is None else float(data["since"]),
            unconfirmed=tuple(int(r) for r in data.get("unconfirmed", ())),
            went_past=tuple(int(r) for r in data.get("went_past", ())),
        )


def stuck_collectives(
    counters: Iterable[GroupCounters], ranks: Sequence[int], min_idle_s: float = 0.0
) -> list[StuckCollective]:
    """Every group with a collective that some member waits in and none completed.

    ``ranks`` are the run's ranks, all members of :data:`WORLD` (one without a row
    entered nothing there yet); a point-to-point pair's members are its two ranks; other
    groups' members are the ranks that reported them (the agent lists every group a rank
    belongs to, at 0 before its first collective there).
    A rank that finished is a member too: a peer waiting for it waits for ever. Counters
    count as where a rank stopped when a heartbeat read them ``min_idle_s`` or more after
    its last step (a heartbeat of a rank that is merely slow shows a collective it will
    leave). Ordered
    most telling first: groups with ranks missing, then by the number of waiting ranks.
    """
    by_group: dict[str, dict[int, GroupCounters]] = {}
    for c in counters:
        by_group.setdefault(c.group, {})[c.rank] = c
    out = []
    for group, rows in by_group.items():
        members = set(ranks) if group == WORLD else set(_pair(group))
        for r in members - rows.keys():  # a member with no row entered nothing there yet
            rows[r] = GroupCounters(r, group, 0, 0, heartbeat=False)
        stuck = _stuck(group, rows, min_idle_s)
        if stuck is not None:
            out.append(stuck)
    out.sort(key=lambda s: (not s.never_entered, -len(s.waiting), s.group))
    return out


def describe(s: StuckCollective) -> str:
    """``rank 5 never entered all_reduce #41,200 of group world; 7 ranks wait in it since
    10:42:07 UTC`` (one clause of a hang's message)."""
    what = f"{s.op or 'collective'} #{fmt.step(s.seq)} of group {s.group}"
    since = f" since {fmt.clock(s.since)}" if s.since is not None else ""
    n = len(s.waiting)
    if not s.never_entered:
        return (
            f"all {n} ranks wait in {what}{since}; none is missing, so the fault is below "
            f"the ranks (transport or link)"
        )
    who = fmt.ranks(s.never_entered)
    waits = f"{n} ranks wait" if n != 1 else "1 rank waits"
    text = f"{who} never entered {what}; {waits} in it{since}"
    if s.went_past:
        verb = "waits" if len(s.went_past) == 1 else "wait"
        text += f" ({fmt.ranks(s.went_past)} went past it and {verb} in a later one)"
    if s.unconfirmed:
        text += f" ({fmt.ranks(s.unconfirmed)} sent no heartbeat: counters from its last window)"
    return text


def _pair(group: str) -> tuple[int, ...]:
    """The two ranks of a point-to-point sequence (the agent names it
    ``<group>:p2p:<lo>-<hi>``): both are members even if one never sent or received."""
    m = P2P.search(group)
    return (int(m[1]), int(m[2])) if m else ()


def _stuck(group: str, rows: dict[int, GroupCounters], min_idle_s: float) -> StuckCollective | None:
    # Only where it stopped tells which one a rank waits in (a window's counters may be
    # older than the rank: a collective it has long left).
    in_flight = [c.completed + 1 for c in rows.values() if c.entered > c.completed and c.stopped(min_idle_s)]
    if not in_flight:
        return None  # nobody known to be inside a collective
    n = min(in_flight)
    if any(not c.stopped(min_idle_s) for c in rows.values() if c.entered >= n):
        return None  # not known to be still inside it
    missing = sorted(r for r, c in rows.items() if c.entered < n)
    waiting = sorted(r for r, c in rows.items() if c.entered >= n and c.completed < n)
    went_past = tuple(sorted(r for r, c in rows.items() if c.completed >= n))
    # A waiting rank's counters describe collective n: the oldest one it has in flight.
    inside = [rows[r] for r in waiting]
    ops = sorted({c.op for c in inside if c.op is not None})
    if went_past and not (ops and set(ops) <= ONE_SIDED):
        return None  # a symmetric collective completed by one rank: the waiting ones moved on
    times = [c.since for c in inside if c.since is not None]
    return StuckCollective(
        group=group,
        op=ops[0] if len(ops) == 1 else ("/".join(ops) if ops else None),
        seq=n,
        never_entered=tuple(missing),
        waiting=tuple(waiting),
        since=min(times) if times else None,
        # No heartbeat, or counters below what others completed (the rank took part in
        # those collectives, so they are older than its truth).
        unconfirmed=tuple(r for r in missing if not rows[r].stopped(min_idle_s) or rows[r].entered < n - 1),
        went_past=went_past,
    )
