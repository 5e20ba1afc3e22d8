"""Captures in the analysis pass: asked for when a flag opens, explained once answered.

Runs inside the run's analysis transaction (its lock), after the flags are written:

1. **Trigger.** A straggler or regression flag that opened in this pass asks for a capture
   of its ranks and their peers (a job-wide regression: the whole job, capped), at most
   one per run per ``min_interval_s`` (``STEPWATCH_CAPTURE_*``).
2. **Explanation.** A capture every targeted rank answered (``done`` or ``missed``), or
   whose time ran out, is explained (:func:`..analysis.captures.explain`) from the ranks'
   stored profiler windows of the captured steps and their collectives' wait and
   transfer. The explanation is the capture's ``result``; a capture a flag asked for also
   puts it in that event's evidence (``capture``) and message, which the page, ``stepwatch
   top`` and the webhook (sent again, as for a newly diagnosed hang) show.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

from sqlalchemy import Connection, Table, select, update

from stepwatch.sketch import LogSketch

from ..analysis.captures import CapturedRank, CollectiveTimes, OpTime, explain
from ..analysis.types import Finding
from ..ingest import profiles
from ..reads.runs import RunInfo
from ..steering import directives
from ..storage.models import (
    CollectiveStat,
    Directive,
    DirectiveAck,
    Event,
    ProfilePending,
    ProfileWindow,
    unix,
)
from .inputs import RankRow
from .outputs import CAPTURE_MARK, Transition, capture_sentence

D = cast(Table, Directive.__table__)
ACK = cast(Table, DirectiveAck.__table__)
EV = cast(Table, Event.__table__)
PW = cast(Table, ProfileWindow.__table__)
CS = cast(Table, CollectiveStat.__table__)
PP = cast(Table, ProfilePending.__table__)
#: Flags that ask for a capture when they open.
TRIGGERS = frozenset({"straggler", "regression"})


@dataclass(frozen=True)
class CaptureConfig:
    on_flag: bool = True
    min_interval_s: float = 600.0
    steps: int = directives.CAPTURE_STEPS
    max_cost_s: float = 5.0
    max_bytes: int = 0


def on_pass(
    conn: Connection,
    run: RunInfo,
    transitions: Sequence[Transition],
    ranks: Sequence[RankRow],
    cfg: CaptureConfig,
    now: datetime,
) -> list[Transition]:
    """Ask for the captures this pass's flags call for; explain the answered ones. Returns
    the events whose evidence gained an explanation (for the webhook)."""
    if cfg.on_flag:
        _trigger(conn, run, transitions, ranks, cfg, now)
    return [t for t in (_explain(conn, run, row, ranks, now) for row in _unexplained(conn, run.id)) if t]


def _trigger(
    conn: Connection,
    run: RunInfo,
    transitions: Sequence[Transition],
    ranks: Sequence[RankRow],
    cfg: CaptureConfig,
    now: datetime,
) -> None:
    opened = [
        t.finding
        for t in transitions
        if t.previous_status is None and t.finding.status == "open" and t.finding.kind in TRIGGERS
    ]
    if not opened or not ranks:
        return
    since = now.timestamp() - cfg.min_interval_s
    recent = conn.execute(
        select(D.c.created_at)
        .where(D.c.run_id == run.id, D.c.kind == "capture", D.c.event_id.is_not(None))
        .order_by(D.c.id.desc())
        .limit(1)
    ).scalar()
    if recent is not None and _ts(recent) > since:
        return
    f = max(opened, key=lambda x: x.cost_seconds)  # the costliest flag of the pass
    event_id = conn.execute(
        select(EV.c.id).where(EV.c.run_id == run.id, EV.c.key == f.key, EV.c.first_step == f.first_step)
    ).scalar()
    # Ranks that finished would never answer (the explanation would wait for its expiry).
    running = {r.rank for r in ranks if r.final_step is None or r.last_step > r.final_step}
    flagged = [r for r in f.ranks if r in running]
    if not running or (f.ranks and not flagged):
        return
    pool = directives.with_peers(conn, run.id, flagged) if flagged else sorted(running)
    targets = directives.cap_ranks([r for r in pool if r in running], flagged)
    plan = directives.plan_capture(conn, run.id, targets, steps=cfg.steps, max_cost_s=cfg.max_cost_s, now=now)
    directives.create_capture(
        conn,
        run.id,
        plan,
        reason=f"flag {f.key}",
        event_id=event_id,
        subject=flagged,
        now=now,
        trace_max_bytes=cfg.max_bytes,
    )


def _ts(t: datetime) -> float:
    return unix(t) or 0.0


def _unexplained(conn: Connection, run_id: int) -> list[Any]:
    return list(
        conn.execute(
            select(D.c.id, D.c.ranks, D.c.params, D.c.event_id, D.c.expires_at).where(
                D.c.run_id == run_id, D.c.kind == "capture", D.c.result.is_(None)
            )
        )
    )


def _median(sketch: dict[str, Any] | None) -> float | None:
    if not sketch:
        return None
    return LogSketch.from_dict(sketch).quantile(0.5)


def _captured(
    conn: Connection, run_id: int, first_step: int, rank: RankRow | None, rank_id: int, ack: Any
) -> CapturedRank:
    host = rank.host if rank is not None else None
    state = ack.state if ack is not None else None
    if state != "done":
        why = (ack.reason if ack is not None else None) or (
            "no answer" if ack is None else f"answered {state}"
        )
        return CapturedRank(rank_id, host, 0, why, None, None, None, None, None, None)
    step = ack.first_step if ack.first_step is not None else first_step
    pw = conn.execute(
        select(PW).where(PW.c.run_id == run_id, PW.c.rank == rank_id, PW.c.first_step == step)
    ).first()
    if pw is None or not pw.n_steps:
        return CapturedRank(
            rank_id, host, 0, "its profiler window was not stored", None, None, None, None, None, None
        )
    colls = {
        c.op: CollectiveTimes(c._mapping["count"], _median(c.duration), _median(c.wait), _median(c.transfer))
        for c in conn.execute(
            select(CS).where(CS.c.run_id == run_id, CS.c.rank == rank_id, CS.c.first_step == step)
        )
    }
    ops = tuple(
        OpTime(str(o.get("name", "")), float(o.get("self_s", 0.0)), float(o.get("count", 0.0)))
        for o in (pw.top_ops or [])
    )
    return CapturedRank(
        rank_id,
        host,
        pw.n_steps,
        None,
        pw.step_s,
        pw.compute_s,
        pw.comm_overlapped_s,
        pw.comm_exposed_s,
        pw.data_wait_s,
        pw.idle_s,
        top_ops=ops,
        collectives=colls,
        device=pw.device,
        sm_clock_mhz=pw.sm_clock_mhz,
        power_w=pw.power_w,
        temperature_c=pw.temperature_c,
        throttle_reasons=tuple(pw.throttle_reasons or ()),
        cost_s=pw.cost_s,
    )


def _explain(
    conn: Connection, run: RunInfo, row: Any, ranks: Sequence[RankRow], now: datetime
) -> Transition | None:
    targeted: list[int] = list(row.ranks or [])
    acks = {a.rank: a for a in conn.execute(select(ACK).where(ACK.c.directive_id == row.id))}
    answered = [r for r in targeted if r in acks and acks[r].state in ("done", "missed")]
    if len(answered) < len(targeted) and _ts(row.expires_at) > now.timestamp():
        return None
    by_rank = {r.rank: r for r in ranks}
    params = dict(row.params)
    first, k = int(params["first_step"]), int(params["steps"])
    # Wait and transfer are split once every asked rank's entry is in; with a rank that
    # missed by its ack alone (no entry), split now among the ranks that were captured.
    if conn.execute(select(PP.c.first_step).where(PP.c.run_id == run.id, PP.c.first_step == first)).first():
        profiles.finalize(
            conn, run_id=run.id, first_step=first, window_steps=run.window_steps, world_size=run.world_size
        )
    captured = [_captured(conn, run.id, first, by_rank.get(r), r, acks.get(r)) for r in targeted]
    subject = [r for r in params.get("subject", []) if r in targeted]
    explanation = explain(captured, subject)
    result = explanation.to_evidence()
    result.update(
        first_step=first,
        steps=k,
        captured=sum(1 for c in captured if c.n_steps),
        ranks=len(targeted),
        cost_s=max((c.cost_s for c in captured if c.cost_s is not None), default=None),
    )
    if not subject:
        result["message"] = f"{result['captured']} of {len(targeted)} ranks captured"
    conn.execute(update(D).where(D.c.id == row.id).values(result=result, done_at=now))
    if row.event_id is None:
        return None
    return _to_event(conn, run.name, row.id, row.event_id, result, now)


def evidence_of(ident: int, result: dict[str, Any]) -> dict[str, Any]:
    """What an event keeps of its capture's result (the per-rank detail stays with the capture)."""
    return {
        "id": ident,
        "first_step": result["first_step"],
        "steps": result["steps"],
        "message": result["message"],
        "findings": result.get("findings", {}),
        "missed": result.get("missed", {}),
        "captured": result["captured"],
        "ranks": result["ranks"],
    }


def _to_event(
    conn: Connection, run: str, ident: int, event_id: int, result: dict[str, Any], now: datetime
) -> Transition | None:
    ev = conn.execute(select(EV).where(EV.c.id == event_id)).first()
    if ev is None:
        return None
    evidence = {**dict(ev.evidence), "capture": evidence_of(ident, result)}
    message = ev.message.split(CAPTURE_MARK)[0] + capture_sentence(evidence["capture"])
    conn.execute(
        update(EV)
        .where(EV.c.id == event_id)
        .values(evidence=evidence, message=message[:1024], updated_at=now)
    )
    finding = Finding(
        kind=ev.kind,
        run=run,
        key=ev.key,
        cause=ev.cause,
        ranks=tuple(ev.ranks),
        hosts=tuple(ev.hosts),
        first_step=ev.first_step,
        last_step=ev.last_step,
        status=ev.status,
        evidence=evidence,
        cost_seconds=ev.cost_seconds,
        cost_ratio=ev.cost_ratio,
        message=message[:1024],
    )
    return Transition(finding, ev.status)
