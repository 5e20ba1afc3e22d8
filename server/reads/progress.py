"""The run overview's plan, progress and analysis sections.

One row read (the run's analysis state) whatever the run's length: the worker keeps the
running totals (:class:`~.analysis.pipeline.ProgressTally`) as it analyses windows, so the
overview never scans a month of steps to find the calendar efficiency. Tokens done is
the live total the overview already has; the projection uses
:func:`~.analysis.progress.project`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, select

from ..analysis.pipeline import RunAnalysis
from ..analysis.progress import calendar_efficiency, project
from ..schemas.responses import AnalysisOut, PlanOut, ProgressOut
from ..storage.models import AnalysisState, Run, unix

STATE = AnalysisState.__table__
RUNS = Run.__table__


@dataclass(frozen=True)
class Sections:
    plan: PlanOut | None
    progress: ProgressOut | None
    analysis: AnalysisOut | None


def sections(conn: Connection, run_id: int, window_steps: int, tokens_done: float) -> Sections:
    """Plan, progress and analysis of a run (``None`` where there is nothing to say)."""
    plan_row = conn.execute(
        select(RUNS.c.target_tokens, RUNS.c.deadline, RUNS.c.config_fingerprint, RUNS.c.baseline_run).where(
            RUNS.c.id == run_id
        )
    ).one()
    deadline = unix(plan_row.deadline)
    plan = None
    if any(v is not None for v in plan_row):
        plan = PlanOut(
            target_tokens=plan_row.target_tokens,
            deadline=deadline,
            config_fingerprint=plan_row.config_fingerprint,
            baseline_run=plan_row.baseline_run,
        )
    state = conn.execute(select(STATE).where(STATE.c.run_id == run_id)).first()
    if state is None:
        return Sections(plan, None, None)
    analysis = RunAnalysis.from_state("", state.state)
    status = AnalysisOut(
        windows_analysed=state.next_window,
        analysed_through_step=state.next_window * window_steps,
        baseline=state.baseline_source,
        updated_at=unix(state.updated_at) or 0.0,
        stage_imbalance=analysis.imbalance.message if analysis.imbalance else None,
    )
    return Sections(plan, _progress(analysis, plan_row, deadline, tokens_done), status)


def _progress(
    analysis: RunAnalysis, plan_row: Any, deadline: float | None, tokens_done: float
) -> ProgressOut:
    tally = analysis.progress
    wall = tally.wall_s
    eff = calendar_efficiency(tally.productive_s, wall) if wall else None
    target = plan_row.target_tokens
    p = project(
        target_tokens=float(target) if target else max(tokens_done, 1.0),
        tokens_done=tokens_done,
        recent=tally.throughput_windows(),
        now=time.time(),
        efficiency=eff if eff else None,
        deadline=deadline if target else None,
    )
    has_target = bool(target)
    return ProgressOut(
        tokens_done=tokens_done,
        target_tokens=target,
        fraction_done=p.fraction_done if has_target else None,
        tokens_per_s=p.tokens_per_s,
        step_time_s=p.step_time_s,
        tokens_per_step=p.tokens_per_step,
        productive_s=tally.productive_s,
        wall_s=wall,
        calendar_efficiency=eff,
        remaining_tokens=p.remaining_tokens if has_target else None,
        remaining_steps=p.remaining_steps if has_target else None,
        eta_s=p.eta_s if has_target else None,
        finish_at=p.finish_at if has_target else None,
        finish_early_at=p.finish_early_at if has_target else None,
        finish_late_at=p.finish_late_at if has_target else None,
        deadline=deadline,
        required_step_time_s=p.required_step_time_s,
        on_track=p.on_track,
    )
