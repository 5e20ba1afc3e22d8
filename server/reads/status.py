"""A run's status, ``live``, ``finished``, ``stalled`` or ``hung``: defined here once and
read by the API (``/runs``, its ``?status=`` filter, ``/runs/{run}``), the web page,
``stepwatch top`` (through the API) and ``/metrics``, so that they never disagree.

``finished``
    every rank sent its final batch (``close()``: ``ranks.final_step >= last_step``) and
    as many ranks as the world size have reported;
``hung``
    the analysis has an open hang event for the run;
``stalled``
    no step for longer than the hang threshold (``max(k x step time, floor)``, the
    analysis's own rule and settings: ``STEPWATCH_HANG_K``, ``STEPWATCH_HANG_FLOOR_S``)
    but no hang flagged (yet, or ever: the worker only analyses runs with recent batches,
    so a run whose training was killed ends here);
``live``
    otherwise.

The order is the precedence: a finished run is finished even if a hang is still open
(the next analysis pass closes it), and a flagged hang says more than a silence.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Literal

from sqlalchemy import Connection, Select, and_, case, exists, func, literal, select
from sqlalchemy.sql.elements import ColumnElement

from ..analysis.hangs import hang_threshold_s
from ..settings import Settings
from ..storage.models import Event, JobStep, Rank, Run

RunStatus = Literal["live", "finished", "stalled", "hung"]
#: Every status, in a fixed order (the exporter's label values).
STATUSES: tuple[RunStatus, ...] = ("live", "finished", "stalled", "hung")

#: One line per status, for tooltips and help text.
MEANING: dict[RunStatus, str] = {
    "live": "steps are arriving",
    "finished": "every rank sent its final batch",
    "stalled": "no step for longer than the hang threshold, no hang flagged",
    "hung": "the analysis flagged a hang",
}

RUNS = Run.__table__
RANKS = Rank.__table__
JS = JobStep.__table__
EV = Event.__table__


@dataclass(frozen=True)
class StatusRule:
    """The silence after which a run that has not finished is stalled (the hang threshold)."""

    k: float = 10.0
    floor_s: float = 60.0
    startup_s: float = 600.0

    @classmethod
    def from_settings(cls, settings: Settings) -> StatusRule:
        return cls(k=settings.hang_k, floor_s=settings.hang_floor_s, startup_s=settings.hang_startup_s)

    def threshold_s(self, median_step_s: float | None) -> float:
        """The analysis' hang threshold for a run of this median step time (None: none
        known past warm-up yet)."""
        return hang_threshold_s(median_step_s, self.k, self.floor_s, self.startup_s)


#: The analysis's own defaults (``Settings.hang_k``, ``hang_floor_s``, ``hang_startup_s``).
DEFAULT_RULE = StatusRule()


@dataclass(frozen=True)
class RunState:
    """What a run's status is decided from, and the status."""

    status: RunStatus
    last_seen: datetime | None  #: UTC; the latest step any rank reported
    ranks_finished: int
    #: Ranks whose newest step is at or after the ``since_step`` asked for the run (0
    #: when none was asked): counted in the same pass over the ranks (``/metrics``).
    ranks_since: int = 0


def classify(
    *,
    world_size: int,
    ranks_finished: int,
    open_hang: bool,
    last_seen: float | None,
    step_time_s: float | None,
    now: float,
    rule: StatusRule,
) -> RunStatus:
    """The status from plain values (see the module docstring); ``last_seen`` and ``now``
    in epoch seconds."""
    if world_size > 0 and ranks_finished >= world_size:
        return "finished"
    if open_hang:
        return "hung"
    if last_seen is None or now - last_seen > rule.threshold_s(step_time_s):
        return "stalled"
    return "live"


def rank_finished() -> ColumnElement[bool]:
    """A row of ``ranks`` that sent its final batch (``close()``)."""
    return and_(RANKS.c.final_step.is_not(None), RANKS.c.final_step >= RANKS.c.last_step)


def open_hang() -> ColumnElement[bool]:
    """A row of ``events`` that is an open hang."""
    return and_(EV.c.kind == "hang", EV.c.status == "open")


def finished_run() -> ColumnElement[bool]:
    """:func:`classify`'s ``finished`` as a condition on ``runs``, from the same
    :func:`rank_finished` that :func:`run_states` counts (``GET /runs?status=``)."""
    # An uncorrelated IN, one pass over the ranks: a count per run correlated to ``runs``
    # was 130-170 ms at 10,000 runs on PostgreSQL (a subplan per run), this 10-15 ms.
    run = RUNS.alias("run")
    done = (
        select(RANKS.c.run_id)
        .join(run, run.c.id == RANKS.c.run_id)
        .where(rank_finished())
        .group_by(RANKS.c.run_id, run.c.world_size)
        .having(and_(run.c.world_size > 0, func.count() >= run.c.world_size))
    )
    return RUNS.c.id.in_(done)


def hung_run() -> ColumnElement[bool]:
    """A run with an open hang (:func:`classify`'s ``hung``, before its precedence)."""
    return exists().where(EV.c.run_id == RUNS.c.id, open_hang())


def utc(value: Any) -> datetime | None:
    """A stored timestamp as an aware UTC datetime (SQLite gives naive ones)."""
    if value is None:
        return None
    if value.tzinfo is None:
        return value.replace(tzinfo=timezone.utc)  # type: ignore[no-any-return]
    return value.astimezone(timezone.utc)  # type: ignore[no-any-return]


def run_states(
    conn: Connection,
    run_ids: Collection[int] | Select[tuple[int]] | None = None,
    *,
    rule: StatusRule = DEFAULT_RULE,
    now: float | None = None,
    since_step: Mapping[int, int] | None = None,
) -> dict[int, RunState]:
    """Status of the given runs (all runs when None) in two queries, whatever the runs'
    length: the ranks' aggregate with each run's latest step, and the open hangs. With
    ``since_step``, the same pass over the ranks counts those at or after it per run.
    ``run_ids`` may be a query of ids (``SELECT runs.id ... WHERE``), read by the
    queries themselves rather than sent as one bound parameter per run."""
    now = time.time() if now is None else now
    finished = rank_finished()
    since = (
        case((RANKS.c.last_step >= case(dict(since_step), value=RANKS.c.run_id, else_=None), 1), else_=0)
        if since_step
        else literal(0)
    )
    latest_step_time = (
        select(JS.c.step_time_sum / JS.c.ranks)
        .where(JS.c.run_id == RUNS.c.id, JS.c.ranks > 0)
        .order_by(JS.c.step.desc())
        .limit(1)
        .scalar_subquery()
    )
    agg = select(
        RANKS.c.run_id,
        func.count().label("ranks"),
        func.sum(case((finished, 1), else_=0)).label("finished"),
        func.max(RANKS.c.last_seen).label("last_seen"),
        func.sum(since).label("since"),
    ).group_by(RANKS.c.run_id)
    hangs = select(EV.c.run_id).where(open_hang()).distinct()
    ids: list[int] | Select[tuple[int]] | None
    if isinstance(run_ids, Select):
        ids = run_ids.correlate(None)  # its own FROM runs, never the enclosing query's
    else:
        ids = None if run_ids is None else list(run_ids)
    if ids is not None:
        # In the aggregate too: joined to the page of runs afterwards, it aggregated the
        # ranks of every run stored (a page of 50 runs cost 37 ms at 10,000 runs on SQLite).
        agg = agg.where(RANKS.c.run_id.in_(ids))
        hangs = hangs.where(EV.c.run_id.in_(ids))
    ranks = agg.subquery()
    q = select(
        RUNS.c.id, RUNS.c.world_size, ranks.c.finished, ranks.c.last_seen, latest_step_time, ranks.c.since
    ).select_from(RUNS.outerjoin(ranks, ranks.c.run_id == RUNS.c.id))
    if ids is not None:
        q = q.where(RUNS.c.id.in_(ids))
    hung = set(conn.execute(hangs).scalars())
    out = {}
    for run_id, world_size, n_finished, seen, step_time, n_since in conn.execute(q):
        last_seen = utc(seen)
        n = int(n_finished or 0)
        out[run_id] = RunState(
            status=classify(
                world_size=world_size,
                ranks_finished=n,
                open_hang=run_id in hung,
                last_seen=None if last_seen is None else last_seen.timestamp(),
                step_time_s=None if step_time is None else float(step_time),
                now=now,
                rule=rule,
            ),
            last_seen=last_seen,
            ranks_finished=n,
            ranks_since=int(n_since or 0),
        )
    return out
