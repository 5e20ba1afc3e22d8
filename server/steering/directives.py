"""Directives: what the collector asks of a run's ranks, chosen and written here.

A **capture** asks a set of ranks to profile the same steps ``S .. S+K-1``. ``S`` must
still lie ahead of every selected rank when the directive reaches it: it is delivered in
the answer to the rank's next batch (up to one send interval away) and applied when the
rank closes its next window (one more), while the newest step the collector has seen is
already up to an interval behind the rank. So ``S`` is the furthest reported step plus
:data:`LEAD_INTERVALS` send intervals (the slowest rank's) and :data:`LEAD_SLACK_S` of
steps, at the run's current step time: the slack covers what does not scale with the
interval (the delivery cache's second, a POST's round trip and a late window close on a
loaded host; at a 1 s interval three intervals alone left a rank one step short). A rank
that still misses it says so in its ack.

A **config** directive carries new live settings (``stepwatch.wire.LIVE_SETTINGS``) for the
whole run or some ranks; the newest one for a set of ranks replaces older ones (they
expire), and stays live so that a rank that has not applied it yet still gets it.

Targets: one rank with its peers (every rank that shares a communicator group with it,
``rank_groups``; the world when the run reports none), a host, explicit ranks, or the
whole job, capped at :data:`MAX_CAPTURE_RANKS` (the nearest ranks by number are kept).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, cast

from sqlalchemy import Connection, Table, func, insert, select, update

from stepwatch import wire

from ..storage.models import Directive, ProfileWindow, Rank, RankGroup, RankWindow

DIRECTIVES = cast(Table, Directive.__table__)
RANKS = cast(Table, Rank.__table__)
RW = cast(Table, RankWindow.__table__)
PW = cast(Table, ProfileWindow.__table__)
RG = cast(Table, RankGroup.__table__)

#: Send intervals of steps between the furthest reported step and a capture's first step.
LEAD_INTERVALS = 3.0
#: Seconds of steps added to that lead, whatever the interval.
LEAD_SLACK_S = 5.0
#: A rank's send interval when it did not report one (the agent's default).
DEFAULT_INTERVAL_S = 10.0
#: Most ranks one capture profiles (each uploads a profiler entry the collector lines up).
MAX_CAPTURE_RANKS = 64
#: Default capture length (steps).
CAPTURE_STEPS = 4
#: A config directive stays live this long (until a newer one replaces it).
CONFIG_LIFETIME = timedelta(days=365)


@dataclass(frozen=True)
class CapturePlan:
    """A capture as decided: its steps, ranks and what was cut to fit."""

    first_step: int
    steps: int
    requested_steps: int
    ranks: list[int]
    notes: list[str]
    expires_at: datetime
    estimated_cost_s: float | None


def _furthest_and_pace(conn: Connection, run_id: int) -> tuple[int, float | None, float]:
    """The furthest reported step, the run's recent step time and the slowest send interval."""
    row = conn.execute(
        select(func.max(RANKS.c.last_step), func.max(RANKS.c.send_interval_s)).where(RANKS.c.run_id == run_id)
    ).one()
    furthest, interval = int(row[0] or 0), float(row[1] or DEFAULT_INTERVAL_S)
    newest = conn.execute(select(func.max(RW.c.window)).where(RW.c.run_id == run_id)).scalar()
    step_s = None
    if newest is not None:
        sums = conn.execute(
            select(func.sum(RW.c.step_time_sum), func.sum(RW.c.n_steps)).where(
                RW.c.run_id == run_id, RW.c.window >= newest - 1
            )
        ).one()
        if sums[1]:
            step_s = float(sums[0]) / float(sums[1])
    return furthest, step_s, interval


def _cost_per_step(conn: Connection, run_id: int) -> float | None:
    """Median self-measured profiler cost per profiled step of the run's newest windows."""
    rows = conn.execute(
        select(PW.c.cost_s, PW.c.n_steps)
        .where(PW.c.run_id == run_id, PW.c.n_steps > 0, PW.c.cost_s.is_not(None))
        .order_by(PW.c.first_step.desc())
        .limit(64)
    ).all()
    per = [float(r.cost_s) / r.n_steps for r in rows]
    return statistics.median(per) if per else None


def all_ranks(conn: Connection, run_id: int) -> list[int]:
    return list(
        conn.execute(select(RANKS.c.rank).where(RANKS.c.run_id == run_id).order_by(RANKS.c.rank)).scalars()
    )


def host_ranks(conn: Connection, run_id: int, host: str) -> list[int]:
    return list(
        conn.execute(
            select(RANKS.c.rank).where(RANKS.c.run_id == run_id, RANKS.c.host == host).order_by(RANKS.c.rank)
        ).scalars()
    )


def with_peers(conn: Connection, run_id: int, ranks: Sequence[int]) -> list[int]:
    """``ranks`` and every rank that shares a communicator group with one of them (the
    whole run when it reports no groups)."""
    groups = select(RG.c.group_name).where(RG.c.run_id == run_id, RG.c.rank.in_(list(ranks)))
    peers = set(
        conn.execute(select(RG.c.rank).where(RG.c.run_id == run_id, RG.c.group_name.in_(groups))).scalars()
    )
    if not peers:
        peers = set(all_ranks(conn, run_id))
    return sorted(peers | set(ranks))


def cap_ranks(ranks: Sequence[int], keep: Sequence[int], cap: int = MAX_CAPTURE_RANKS) -> list[int]:
    """At most ``cap`` of ``ranks``: ``keep`` first, then the nearest to them by number."""
    chosen = sorted(set(keep) & set(ranks))[:cap]
    if len(set(ranks)) <= cap:
        return sorted(set(ranks))
    centre = chosen or [min(ranks)]
    rest = sorted(set(ranks) - set(chosen), key=lambda r: (min(abs(r - c) for c in centre), r))
    return sorted(chosen + rest[: cap - len(chosen)])


def plan_capture(
    conn: Connection,
    run_id: int,
    ranks: Sequence[int],
    *,
    steps: int,
    max_cost_s: float,
    now: datetime,
) -> CapturePlan:
    """Choose the capture's steps and length (see the module docstring)."""
    furthest, step_s, interval = _furthest_and_pace(conn, run_id)
    notes: list[str] = []
    lead_s = LEAD_INTERVALS * interval + LEAD_SLACK_S
    lead = math.ceil(lead_s / step_s) if step_s and step_s > 0 else 100
    first = furthest + max(lead, 2)
    # One profiler window at a time on a rank: after any live capture of the same ranks
    # (with a step between, the edge the next one starts at).
    for d in conn.execute(
        select(DIRECTIVES.c.ranks, DIRECTIVES.c.params).where(
            DIRECTIVES.c.run_id == run_id, DIRECTIVES.c.kind == "capture", DIRECTIVES.c.expires_at > now
        )
    ):
        if d.ranks is None or set(d.ranks) & set(ranks):
            first = max(first, int(d.params["first_step"]) + int(d.params["steps"]) + 1)
    per_step = _cost_per_step(conn, run_id)
    k = steps
    if per_step is not None and per_step > 0 and per_step * k > max_cost_s:
        k = max(1, min(k, math.floor(max_cost_s / per_step)))
        if k < steps:
            notes.append(
                f"shortened from {steps} to {k} steps: {per_step * steps:.2f} s estimated cost per rank "
                f"over the budget of {max_cost_s:g} s (STEPWATCH_CAPTURE_MAX_COST_S)"
            )
    until_s = (first + k - furthest) * (step_s or 1.0) + 2 * interval
    return CapturePlan(
        first_step=first,
        steps=k,
        requested_steps=steps,
        ranks=list(ranks),
        notes=notes,
        expires_at=now + timedelta(seconds=max(until_s, 60.0)),
        estimated_cost_s=per_step * k if per_step is not None else None,
    )


def create_capture(
    conn: Connection,
    run_id: int,
    plan: CapturePlan,
    *,
    reason: str,
    event_id: int | None,
    subject: Sequence[int],
    now: datetime,
    trace_max_bytes: int = 0,
) -> int:
    """Write a capture; ``subject`` are the ranks its explanation compares with their
    peers, and (at most two of them) upload their raw trace when ``trace_max_bytes``."""
    params = {
        "subject": list(subject),
        "trace_ranks": list(subject)[:2] if trace_max_bytes > 0 else [],
        "trace_max_bytes": trace_max_bytes,
        "first_step": plan.first_step,
        "steps": plan.steps,
        "requested_steps": plan.requested_steps,
        "notes": plan.notes,
        "estimated_cost_s": plan.estimated_cost_s,
    }
    return int(
        conn.execute(
            insert(DIRECTIVES)
            .values(
                run_id=run_id,
                kind="capture",
                ranks=plan.ranks,
                params=params,
                reason=reason[:256],
                event_id=event_id,
                created_at=now,
                expires_at=plan.expires_at,
            )
            .returning(DIRECTIVES.c.id)
        ).scalar_one()
    )


def create_config(
    conn: Connection,
    run_id: int,
    settings: dict[str, float],
    ranks: Sequence[int] | None,
    *,
    reason: str,
    now: datetime,
) -> int:
    """A config directive; older live ones it covers expire, their settings merged into
    it (this one's win), so a rank that had not applied them yet still gets them."""
    live = conn.execute(
        select(DIRECTIVES.c.id, DIRECTIVES.c.ranks, DIRECTIVES.c.params)
        .where(DIRECTIVES.c.run_id == run_id, DIRECTIVES.c.kind == "config", DIRECTIVES.c.expires_at > now)
        .order_by(DIRECTIVES.c.id)
    ).all()
    covered = [d for d in live if ranks is None or (d.ranks is not None and set(d.ranks) <= set(ranks))]
    if covered:
        merged: dict[str, float] = {}
        for d in covered:
            merged.update(d.params["settings"])
        settings = {**merged, **settings}
        ids = [d.id for d in covered]
        conn.execute(update(DIRECTIVES).where(DIRECTIVES.c.id.in_(ids)).values(expires_at=now))
    return int(
        conn.execute(
            insert(DIRECTIVES)
            .values(
                run_id=run_id,
                kind="config",
                ranks=list(ranks) if ranks is not None else None,
                params={"settings": settings},
                reason=reason[:256],
                event_id=None,
                created_at=now,
                expires_at=now + CONFIG_LIFETIME,
            )
            .returning(DIRECTIVES.c.id)
        ).scalar_one()
    )


def wire_form(kind: str, ident: int, params: dict[str, Any]) -> dict[str, Any]:
    """The directive as the agent reads it (``stepwatch.wire``'s steering contract)."""
    head = {"id": str(ident), "v": wire.DIRECTIVES_VERSION, "kind": kind}
    if kind == "capture":
        out = {**head, "first_step": params["first_step"], "steps": params["steps"]}
        if params.get("trace_ranks"):
            out.update(trace_ranks=params["trace_ranks"], trace_max_bytes=params["trace_max_bytes"])
        return out
    return {**head, "settings": dict(params["settings"])}


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


__all__ = [
    "CAPTURE_STEPS",
    "MAX_CAPTURE_RANKS",
    "CapturePlan",
    "all_ranks",
    "cap_ranks",
    "create_capture",
    "create_config",
    "host_ranks",
    "plan_capture",
    "wire_form",
    "with_peers",
]
