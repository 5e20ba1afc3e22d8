"""Writes of the analysis worker: events (upserted by run, key and first step) and state.

An event row is one occurrence of a flag: ``(run_id, key, first_step)``. The worker writes
it when the flag opens, refreshes it while it stays open (latest step, evidence, cost) and
closes it; a replayed window cannot duplicate it. A transition (what the webhook sends)
is an event created or changing status, or an open hang whose diagnosis (the stuck
collective) arrived or changed. The window whose analysis opened a
flag is kept in its evidence as ``opened_window`` (and ``opened_step``), so "how many
windows did it take" can be read back later, whatever the flag's later updates.

The state row is written with a compare-and-set on ``version``: a pass that read version
v writes v + 1 only if the row is still at v, else it raises :class:`StateConflictError`
and its transaction (events included) rolls back.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import Connection, delete, insert, select, update

from ..analysis.pipeline import Change
from ..analysis.types import Finding
from ..storage.models import AnalysisState, Event, LinkSample, StepTiming
from .inputs import RANK_CHUNK, staged_ranks

EV = Event.__table__
STATE = AnalysisState.__table__


class StateConflictError(RuntimeError):
    """Another pass wrote the run's analysis state first; this pass must roll back."""


@dataclass(frozen=True, slots=True)
class StoredState:
    """The analysis state row as read at the start of a pass."""

    version: int
    next_window: int
    state: Mapping[str, Any]
    pending: Mapping[int, float]
    baseline_source: str


@dataclass(frozen=True, slots=True)
class Transition:
    """An event that was created or changed status in this pass (what a webhook sends)."""

    finding: Finding
    previous_status: str | None


def load_state(conn: Connection, run_id: int) -> StoredState | None:
    row = conn.execute(select(STATE).where(STATE.c.run_id == run_id)).first()
    if row is None:
        return None
    return StoredState(
        version=row.version,
        next_window=row.next_window,
        state=row.state,
        pending={int(k): float(v) for k, v in dict(row.pending).items()},
        baseline_source=row.baseline_source,
    )


def save_state(
    conn: Connection,
    run_id: int,
    previous: StoredState | None,
    *,
    next_window: int,
    state: Mapping[str, Any],
    pending: Mapping[int, float],
    baseline_source: str,
    now: datetime,
) -> None:
    values = {
        "next_window": next_window,
        "state": dict(state),
        "pending": {str(k): v for k, v in pending.items()},
        "baseline_source": baseline_source,
        "updated_at": now,
    }
    if previous is None:
        conn.execute(insert(AnalysisState).values(run_id=run_id, version=1, **values))
        return
    done = conn.execute(
        update(AnalysisState)
        .where(STATE.c.run_id == run_id, STATE.c.version == previous.version)
        .values(version=previous.version + 1, **values)
    )
    if done.rowcount != 1:
        raise StateConflictError(f"analysis state of run id {run_id} changed under this pass")


Touched = dict[tuple[str, int, str], tuple[Finding, int | None, int | None]]


def _merge(changes: Sequence[Change], open_now: Iterable[Finding]) -> Touched:
    """Latest version of every flag touched in this pass, per detector, with the
    window/step it opened at."""
    out: Touched = {}
    for ch in changes:
        ident = (ch.finding.key, ch.finding.first_step, ch.finding.source)
        opened = out.get(ident, (None, None, None))
        if ch.finding.status == "open":
            out[ident] = (ch.finding, ch.window, ch.finding.last_step)
        else:
            out[ident] = (ch.finding, opened[1], opened[2])
    for f in open_now:
        ident = (f.key, f.first_step, f.source)
        _, window, step = out.get(ident, (None, None, None))
        out[ident] = (f, window, step)
    return out


#: How an event's text names the detector whose evidence was added to it.
SOURCE_WORDS = {"window": "the window detector", "arrivals": "the always-on late-arrival timing"}


def _one_per_key(
    merged: Touched, open_rows: Mapping[str, int]
) -> dict[tuple[str, int], tuple[Finding, int | None, int | None]]:
    """One straggler event per key (rank or host, and cause) however many detectors flag it.

    The per-window detector and the always-on late-arrival detector can both flag
    ``straggler:compute:rank=2``, each from its own first step; two open events for one
    problem would be counted, alerted and read twice. So the findings of one key become
    one: the event already open for the key (``open_rows``: key -> its first step), else the
    earliest one opening now. It stays open while any detector holds it open and closes
    when the last one closes it (``open_now`` is every open flag of the pass, so a closing
    finding with another one still open for its key leaves the event open). The findings
    it is not made from add their evidence under their detector's name (``arrivals.*``).
    (A flag one detector closes and opens again within one pass, a backlog of many
    windows, stays one event.)
    """
    by_key: dict[str, list[tuple[int, tuple[Finding, int | None, int | None]]]] = {}
    out: dict[tuple[str, int], tuple[Finding, int | None, int | None]] = {}
    for (key, first, _), entry in merged.items():
        if entry[0].kind == "straggler":
            by_key.setdefault(key, []).append((first, entry))
        else:
            out[(key, first)] = entry
    for key, entries in by_key.items():
        entries.sort(key=lambda e: (e[1][0].status != "open", e[0]))
        lead_first, (lead, window, step) = entries[0]
        anchor = open_rows.get(key, lead_first if lead.status == "open" else None)
        if anchor is None or (len(entries) == 1 and anchor == lead_first):
            out[(key, lead_first)] = entries[0][1]
            continue
        evidence = dict(lead.evidence)
        sources = {lead.source}
        for _, (other, _, _) in entries[1:]:
            if other.source == lead.source:
                continue
            sources.add(other.source)
            evidence.update({f"{other.source}.{k}": v for k, v in other.evidence.items()})
        message = lead.message
        extra = sorted(sources - {lead.source})
        if extra:
            evidence["detectors"] = float(len(sources))
            message += " Also found by " + " and ".join(SOURCE_WORDS.get(x, x) for x in extra) + "."
        # An existing event keeps its opened_window; a new one opens with the lead's.
        merged_finding = replace(lead, first_step=anchor, evidence=evidence, message=message)
        out[(key, anchor)] = (merged_finding, window, step)
    return out


def write_findings(
    conn: Connection,
    run_id: int,
    changes: Sequence[Change],
    open_now: Iterable[Finding],
    now: datetime,
) -> list[Transition]:
    """Upsert the flags touched in this pass (one event per straggler key, see
    :func:`_one_per_key`); return those created or that changed status."""
    merged = _merge(changes, open_now)
    if not merged:
        return []
    keys = sorted({k for k, _, _ in merged})
    rows = list(
        conn.execute(
            select(EV.c.id, EV.c.key, EV.c.first_step, EV.c.status, EV.c.evidence).where(
                EV.c.run_id == run_id, EV.c.key.in_(keys)
            )
        )
    )
    open_rows: dict[str, int] = {}
    for r in sorted(rows, key=lambda r: r.first_step, reverse=True):
        if r.status == "open":
            open_rows[r.key] = r.first_step  # the earliest open one, should there be two
    events = _one_per_key(merged, open_rows)
    existing = {(r.key, r.first_step): r for r in rows}
    transitions: list[Transition] = []
    for ident, (finding, window, step) in sorted(events.items()):
        row = existing.get(ident)
        evidence: dict[str, Any] = dict(finding.evidence)
        if finding.collective is not None:
            evidence["collective"] = dict(finding.collective)
        old = dict(row.evidence) if row is not None else {}
        for name, value in (("opened_window", window), ("opened_step", step)):
            if name in old:
                evidence[name] = old[name]
            elif value is not None:
                evidence[name] = value
        if "capture" in old:  # a capture's explanation (``captures.py``) outlives the refresh
            evidence["capture"] = old["capture"]
            finding = replace(finding, message=finding.message + capture_sentence(old["capture"]))
        values = _row(finding, evidence, now)
        if row is None:
            conn.execute(insert(Event).values(run_id=run_id, opened_at=now, **values))
            transitions.append(Transition(finding, None))
            continue
        conn.execute(update(Event).where(EV.c.id == row.id).values(**values))
        if row.status != finding.status or _newly_diagnosed(finding, old):
            transitions.append(Transition(finding, row.status))
    return transitions


#: An event message's capture sentence starts with this (``captures.py``).
CAPTURE_MARK = " Capture of steps "


def capture_sentence(capture: Mapping[str, Any]) -> str:
    """The sentence a capture's explanation adds to its event's message."""
    first, k = capture["first_step"], capture["steps"]
    return f"{CAPTURE_MARK}{first}-{first + k - 1}: {capture['message']}"


def _newly_diagnosed(finding: Finding, old_evidence: Mapping[str, Any]) -> bool:
    """An open hang whose diagnosis arrived or changed since it was stored: the webhook
    says it again (heartbeats can come after the threshold passed)."""
    if finding.status != "open" or finding.collective is None:
        return False
    before = old_evidence.get("collective") or {}
    now = finding.collective
    return any(before.get(k) != now.get(k) for k in ("group", "seq", "never_entered", "waiting"))


def _row(f: Finding, evidence: Mapping[str, Any], now: datetime) -> dict[str, Any]:
    return {
        "key": f.key,
        "kind": f.kind,
        "cause": f.cause,
        "ranks": list(f.ranks),
        "hosts": list(f.hosts),
        "first_step": f.first_step,
        "last_step": f.last_step,
        "status": f.status,
        "evidence": dict(evidence),
        "cost_seconds": float(f.cost_seconds),
        "cost_ratio": float(f.cost_ratio),
        "message": f.message[:1024],
        "updated_at": now,
    }


def open_hangs(conn: Connection, run_id: int) -> list[Finding]:
    """Hang events of a run that are open in storage."""
    rows = conn.execute(
        select(EV).where(EV.c.run_id == run_id, EV.c.kind == "hang", EV.c.status == "open")
    ).mappings()
    out = []
    for r in rows:
        evidence = dict(r["evidence"])
        collective = evidence.pop("collective", None)
        out.append(
            Finding(
                kind="hang",
                run="",
                key=r["key"],
                cause=None,
                ranks=tuple(r["ranks"]),
                hosts=tuple(r["hosts"]),
                first_step=r["first_step"],
                last_step=r["last_step"],
                status="open",
                evidence={k: float(v) for k, v in evidence.items()},
                cost_seconds=r["cost_seconds"],
                cost_ratio=r["cost_ratio"],
                message=r["message"],
                collective=collective,
            )
        )
    return out


def utcnow_from(unix_s: float) -> datetime:
    return datetime.fromtimestamp(unix_s, timezone.utc)


def drop_step_timings(conn: Connection, run_id: int, ranks: Sequence[int], through_step: int) -> int:
    """Delete the staged timing (``step_timings`` and ``link_samples``) whose last step is
    at most ``through_step`` (the last step of the last window analysed), late rows of
    earlier windows included; a seek per chunk of ranks. Returns the rows deleted."""
    deleted = 0
    ids = sorted(set(ranks))
    # A batch's row goes with its last step: one that reaches into the next window is read
    # again for that window's steps.
    for model, last in ((StepTiming, StepTiming.last_step), (LinkSample, LinkSample.step)):
        for i in range(0, len(ids), RANK_CHUNK):
            result = conn.execute(
                delete(model).where(
                    model.run_id == run_id,
                    staged_ranks(conn, model.rank, ids[i : i + RANK_CHUNK]),
                    last <= through_step,
                )
            )
            deleted += result.rowcount or 0
    return deleted
