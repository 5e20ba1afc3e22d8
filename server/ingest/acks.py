"""Storing the agents' answers to directives, inside the ingest transaction of their batch.

An answer is an ack (``acks``: a capture scheduled or missed, a config applied or
refused) or a profiler entry that names its capture (``profiles[].capture``: ``done``, or
``missed`` with the reason the window was skipped). One row per directive and rank holds
the latest state, except that a capture's states only move forward (``scheduled`` <
``missed`` < ``done``: a repeated ack never takes back an outcome). Answers to directives
of another run, to ids the collector never issued, or from ranks a directive did not ask,
are ignored: a rank cannot answer for another run or another rank.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, cast

from sqlalchemy import Connection, Table, select

from ..schemas.ingest import IngestPayload
from ..storage.backend import Storage
from ..storage.models import Directive, DirectiveAck

D = cast(Table, Directive.__table__)
ACK = cast(Table, DirectiveAck.__table__)
#: A capture's states in the order they may move (a config's replace each other).
ORDER = {"scheduled": 1, "missed": 2, "done": 3}


def answers(p: IngestPayload) -> dict[int, dict[str, Any]]:
    """Directive id -> this batch's answer (the last one of each id wins)."""
    out: dict[int, dict[str, Any]] = {}
    for a in p.acks or ():
        if a.id.isdigit():
            out[int(a.id)] = {
                "state": a.state,
                "reason": a.reason,
                "settings": a.settings,
                "first_step": None,
            }
    for prof in p.profiles or ():
        if prof.capture is not None and prof.capture.isdigit():
            done = prof.n_steps > 0
            out[int(prof.capture)] = {
                "state": "done" if done else "missed",
                "reason": None if done else prof.skipped,
                "settings": None,
                "first_step": prof.first_step,
            }
    return out


def store(conn: Connection, storage: Storage, run_id: int, p: IngestPayload) -> None:
    """Store the answers a fresh batch carries (nearly all carry none)."""
    got = answers(p)
    if not got:
        return
    rank = p.rank.rank
    asked = conn.execute(select(D.c.id, D.c.ranks).where(D.c.run_id == run_id, D.c.id.in_(list(got)))).all()
    ours = {d.id for d in asked if d.ranks is None or rank in d.ranks}
    if not ours:
        return
    q = select(ACK.c.directive_id, ACK.c.state).where(ACK.c.directive_id.in_(list(ours)), ACK.c.rank == rank)
    before = {r.directive_id: r.state for r in conn.execute(q)}
    now = datetime.now(timezone.utc)
    for ident in sorted(ours):
        a = got[ident]
        if ORDER.get(before.get(ident) or "", 0) > ORDER.get(a["state"], 4):
            continue
        values = {"state": a["state"], "reason": a["reason"], "settings": a["settings"], "at": now}
        if a["first_step"] is not None:
            values["first_step"] = a["first_step"]
        conn.execute(
            storage.insert(ACK)
            .values(directive_id=ident, rank=rank, **values)
            .on_conflict_do_update(index_elements=["directive_id", "rank"], set_=values)
        )


def capture_size(conn: Connection, run_id: int, capture: str | None) -> int | None:
    """How many ranks a capture asked for (its profiler windows complete at that count)."""
    if capture is None or not capture.isdigit():
        return None
    ranks = conn.execute(
        select(D.c.ranks).where(D.c.id == int(capture), D.c.run_id == run_id, D.c.kind == "capture")
    ).scalar()
    return len(ranks) if ranks else None
