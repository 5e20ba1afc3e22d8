"""Reading directives back: captures with their answers and explanation, live configs."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, cast

from sqlalchemy import Connection, Table, select

from ..schemas.responses import CaptureOut, ConfigState, RankAnswer
from ..storage.models import CaptureTrace, Directive, DirectiveAck, Rank

D = cast(Table, Directive.__table__)
ACK = cast(Table, DirectiveAck.__table__)
RANKS = cast(Table, Rank.__table__)
TRACES = cast(Table, CaptureTrace.__table__)
#: Ranks listed by name in a config's state (the counts cover the rest).
LISTED = 64


def _utc(value: datetime) -> datetime:
    """A stored timestamp as an aware UTC datetime (SQLite returns them naive)."""
    return value if value.tzinfo is not None else value.replace(tzinfo=timezone.utc)


def _answers(conn: Connection, ids: list[int]) -> dict[int, list[RankAnswer]]:
    out: dict[int, list[RankAnswer]] = {i: [] for i in ids}
    q = select(ACK).where(ACK.c.directive_id.in_(ids)).order_by(ACK.c.directive_id, ACK.c.rank)
    for a in conn.execute(q):
        out[a.directive_id].append(
            RankAnswer(rank=a.rank, state=a.state, reason=a.reason, settings=a.settings)
        )
    return out


def _traces(conn: Connection, ids: list[int]) -> dict[int, list[dict[str, int]]]:
    out: dict[int, list[dict[str, int]]] = {i: [] for i in ids}
    q = select(TRACES.c.directive_id, TRACES.c.rank, TRACES.c.size).where(TRACES.c.directive_id.in_(ids))
    for t in conn.execute(q.order_by(TRACES.c.directive_id, TRACES.c.rank)):
        out[t.directive_id].append({"rank": t.rank, "size": t.size})
    return out


def capture(row: Any, run: str, answers: list[RankAnswer], traces: list[dict[str, int]]) -> CaptureOut:
    p: dict[str, Any] = dict(row.params)
    return CaptureOut(
        id=row.id,
        run=run,
        first_step=p["first_step"],
        steps=p["steps"],
        requested_steps=p.get("requested_steps", p["steps"]),
        ranks=list(row.ranks or []),
        reason=row.reason,
        event_id=row.event_id,
        notes=list(p.get("notes", [])),
        estimated_cost_s=p.get("estimated_cost_s"),
        created_at=_utc(row.created_at),
        status="done" if row.result is not None else "pending",
        done_at=_utc(row.done_at) if row.done_at is not None else None,
        answers=answers,
        traces=traces,
        result=row.result,
    )


def captures(
    conn: Connection, run_id: int, run: str, *, ident: int | None = None, limit: int = 50
) -> list[CaptureOut]:
    """The run's captures, newest first (or the one with id ``ident``): three queries."""
    q = select(D).where(D.c.run_id == run_id, D.c.kind == "capture")
    if ident is not None:
        q = q.where(D.c.id == ident)
    rows = conn.execute(q.order_by(D.c.id.desc()).limit(limit)).all()
    ids = [r.id for r in rows]
    if not ids:
        return []
    answers, traces = _answers(conn, ids), _traces(conn, ids)
    return [capture(r, run, answers[r.id], traces[r.id]) for r in rows]


def configs(conn: Connection, run_id: int) -> list[ConfigState]:
    """The run's live config directives: requested settings against each rank's answer."""
    now = datetime.now(timezone.utc)
    rows = conn.execute(
        select(D).where(D.c.run_id == run_id, D.c.kind == "config", D.c.expires_at > now).order_by(D.c.id)
    ).all()
    if not rows:
        return []
    reporting = list(conn.execute(select(RANKS.c.rank).where(RANKS.c.run_id == run_id)).scalars())
    by_id = _answers(conn, [r.id for r in rows])
    out = []
    for r in rows:
        answers = {a.rank: a for a in by_id[r.id]}
        targeted = r.ranks if r.ranks is not None else reporting
        out.append(
            ConfigState(
                id=r.id,
                settings=dict(r.params["settings"]),
                ranks=r.ranks,
                created_at=_utc(r.created_at),
                applied=sum(1 for a in answers.values() if a.state == "applied"),
                pending=sorted(k for k in targeted if k not in answers)[:LISTED],
                refused=[a for a in answers.values() if a.state == "refused"],
                in_force={str(k): dict(a.settings) for k, a in sorted(answers.items()) if a.settings}
                if len(answers) <= LISTED
                else {},
            )
        )
    return out
