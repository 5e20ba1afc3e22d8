"""Storing one validated batch: one transaction, idempotent by batch id.

Order inside the transaction: claim the batch id first (a retry finds it taken and
stores nothing), then the rank's latest state, its window summaries and the job-level
per-step rows. Per-step and per-window rows are merged with additive upserts, so a
window split across batches, or ranks arriving in any order, add up to the same rows.
The caller answers 2xx only after this commits.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import Connection, Engine, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.sql.elements import ColumnElement

from .db.models import IngestedBatch, JobStep, Rank, RankWindow, Run
from .profiles import store_profiles
from .schemas import IngestPayload, PlanIn

TAG_CODES = {"warmup": 1, "checkpoint": 2, "eval": 3}


@dataclass(frozen=True)
class RunKey:
    """What ingest needs of a run; immutable once the run exists, so safe to cache."""

    id: int
    window_steps: int
    dp_size: int
    world_size: int = 0
    #: The plan as last stored: (target_tokens, deadline Unix s, fingerprint, baseline run).
    plan: tuple[Any, ...] | None = None


def _plan_row(plan: PlanIn | None) -> dict[str, Any] | None:
    if plan is None:
        return None
    return {
        "target_tokens": plan.target_tokens,
        "deadline": None if plan.deadline is None else datetime.fromtimestamp(plan.deadline, timezone.utc),
        "config_fingerprint": plan.config_fingerprint,
        "baseline_run": plan.baseline_run,
    }


def _plan_key(target: Any, deadline: datetime | None, fingerprint: Any, baseline: Any) -> tuple[Any, ...]:
    if deadline is not None and deadline.tzinfo is None:  # SQLite returns naive UTC datetimes
        deadline = deadline.replace(tzinfo=timezone.utc)
    when = None if deadline is None else round(deadline.timestamp(), 3)
    return (target, when, fingerprint, baseline)


def choose_window_steps(step_times: list[float], window_seconds: float) -> int:
    """Steps per stored rank window: a power of two near ``window_seconds`` of steps.

    Fixed per run at its first batch, so that every rank's windows cover the same steps
    and can be compared window by window.
    """
    positive = [t for t in step_times if t > 0]
    if not positive:
        return 1
    per_step = statistics.median(positive)
    target = max(1.0, window_seconds / per_step)
    return int(min(4096, 2 ** round(math.log2(target))))


class Ingestor:
    """Writes batches; holds a small cache of run keys (never of data)."""

    def __init__(self, engine: Engine, *, window_seconds: float = 10.0, cache_size: int = 1024) -> None:
        self.engine = engine
        self.window_seconds = window_seconds
        self._dialect = engine.dialect.name
        self._runs: OrderedDict[str, RunKey] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    # -- dialect helpers -----------------------------------------------------------
    def _insert(self, table: Any) -> Any:
        mod = postgresql if self._dialect == "postgresql" else sqlite
        return mod.insert(table)

    def _greatest(self, a: ColumnElement[Any], b: ColumnElement[Any]) -> ColumnElement[Any]:
        return func.greatest(a, b) if self._dialect == "postgresql" else func.max(a, b)

    def _least(self, a: ColumnElement[Any], b: ColumnElement[Any]) -> ColumnElement[Any]:
        return func.least(a, b) if self._dialect == "postgresql" else func.min(a, b)

    # -- runs ----------------------------------------------------------------------
    def _run_key(self, conn: Connection, p: IngestPayload) -> RunKey:
        with self._lock:
            key = self._runs.get(p.run)
            if key is not None:
                self._runs.move_to_end(p.run)
        plan = _plan_row(p.plan)
        wanted = None if plan is None else _plan_key(*plan.values())
        if key is not None and (wanted is None or key.plan == wanted):
            return key
        if key is None:
            key = self._load_run(conn, p, plan)
        if plan is not None and key.plan != wanted:
            # Written only when it changes (once per run and replica), not per batch.
            conn.execute(update(Run).where(Run.id == key.id).values(**plan))
            key = replace(key, plan=wanted)
        with self._lock:
            self._runs[p.run] = key
            while len(self._runs) > self._cache_size:
                self._runs.popitem(last=False)
        return key

    def _load_run(self, conn: Connection, p: IngestPayload, plan: dict[str, Any] | None) -> RunKey:
        runs = Run.__table__
        cols = (
            runs.c.id,
            runs.c.window_steps,
            runs.c.dp_size,
            runs.c.world_size,
            runs.c.target_tokens,
            runs.c.deadline,
            runs.c.config_fingerprint,
            runs.c.baseline_run,
        )
        row = conn.execute(select(*cols).where(runs.c.name == p.run)).first()
        if row is None:
            stmt = self._insert(runs).values(
                name=p.run,
                world_size=p.rank.world_size,
                dp_size=p.rank.layout.dp,
                layout=p.rank.layout.model_dump(),
                convention=p.convention.model_dump() if p.convention else None,
                window_steps=choose_window_steps(p.steps.time_s, self.window_seconds),
                created_at=datetime.now(timezone.utc),
                **(plan or {}),
            )
            conn.execute(stmt.on_conflict_do_nothing(index_elements=["name"]))
            row = conn.execute(select(*cols).where(runs.c.name == p.run)).one()
        return RunKey(
            id=row.id,
            window_steps=row.window_steps,
            dp_size=row.dp_size,
            world_size=row.world_size,
            plan=_plan_key(row.target_tokens, row.deadline, row.config_fingerprint, row.baseline_run),
        )

    # -- the batch -----------------------------------------------------------------
    def store(self, p: IngestPayload) -> bool:
        """Store one batch; False if its id was already stored. Raises on DB errors."""
        with self.engine.begin() as conn:
            run = self._run_key(conn, p)
            batches = IngestedBatch.__table__
            claimed = conn.execute(
                self._insert(batches)
                .values(
                    batch_id=p.batch_id,
                    run_id=run.id,
                    rank=p.rank.rank,
                    received_at=datetime.now(timezone.utc),
                )
                .on_conflict_do_nothing(index_elements=["batch_id"])
                .returning(batches.c.batch_id)
            ).first()
            if claimed is None:
                return False
            self._store_rank(conn, run, p)
            if p.steps.time_s:  # a final batch may carry no step
                self._store_windows(conn, run, p)
                self._store_job_steps(conn, run, p)
                if p.profile is not None:
                    self._store_profile(conn, run, p)
            if p.profiles:
                store_profiles(
                    conn,
                    self._insert,
                    run_id=run.id,
                    window_steps=run.window_steps,
                    world_size=run.world_size,
                    p=p,
                )
        return True

    def _store_rank(self, conn: Connection, run: RunKey, p: IngestPayload) -> None:
        t = Rank.__table__
        last_step = p.steps.first + len(p.steps.time_s) - 1
        values = {
            "run_id": run.id,
            "rank": p.rank.rank,
            "host": p.rank.host,
            "local_rank": p.rank.local_rank,
            "coords": dict(p.rank.coords),
            "last_step": last_step,
            "last_seen": datetime.fromtimestamp(p.steps.wall_end, timezone.utc),
            "agent_version": p.agent.version,
            "clock": p.agent.clock,
            "dropped_windows": p.agent.dropped_windows,
            "dropped_steps": p.agent.dropped_steps,
            "hot_path_mean_s": p.agent.hot_path_mean_s,
            "final_step": last_step if p.final else None,
        }
        stmt = self._insert(t).values(**values)
        ex = stmt.excluded
        # Batches of one rank can arrive out of order (retries): counters only grow.
        stmt = stmt.on_conflict_do_update(
            index_elements=["run_id", "rank"],
            set_={
                "host": ex.host,
                "local_rank": ex.local_rank,
                "coords": ex.coords,
                "last_step": self._greatest(t.c.last_step, ex.last_step),
                "last_seen": self._greatest(t.c.last_seen, ex.last_seen),
                "agent_version": ex.agent_version,
                "clock": ex.clock,
                "dropped_windows": self._greatest(t.c.dropped_windows, ex.dropped_windows),
                "dropped_steps": self._greatest(t.c.dropped_steps, ex.dropped_steps),
                "hot_path_mean_s": func.coalesce(ex.hot_path_mean_s, t.c.hot_path_mean_s),
                "final_step": func.coalesce(ex.final_step, t.c.final_step),
            },
        )
        conn.execute(stmt)

    def _store_profile(self, conn: Connection, run: RunKey, p: IngestPayload) -> None:
        """Merge the batch's time breakdown into the window of its last step.

        Means weighted by profiled steps, so a window profiled across two batches adds up.
        SQL evaluates every SET expression against the row as it was, on both backends.
        """
        prof = p.profile
        assert prof is not None
        last = p.steps.first + len(p.steps.time_s) - 1
        window = (last - 1) // run.window_steps if last > 0 else 0
        t = RankWindow.__table__
        n_old = func.coalesce(t.c.profiled_steps, 0)
        n_new = prof.steps

        def merged(col: Any, value: float | None) -> Any:
            if value is None:
                return col
            return (func.coalesce(col, 0.0) * n_old + value * n_new) / (n_old + n_new)

        values: dict[str, Any] = {
            "profiled_steps": n_old + n_new,
            "compute_s": merged(t.c.compute_s, prof.compute_s),
            "comm_overlapped_s": merged(t.c.comm_overlapped_s, prof.comm_overlapped_s),
            "comm_exposed_s": merged(t.c.comm_exposed_s, prof.comm_exposed_s),
            "idle_s": merged(t.c.idle_s, prof.idle_s),
            "comm_wait_s": merged(t.c.comm_wait_s, prof.comm_wait_s),
            "comm_transfer_s": merged(t.c.comm_transfer_s, prof.comm_transfer_s),
        }
        if prof.group_transfer_s is not None:
            values["group_transfer_s"] = dict(prof.group_transfer_s)
        conn.execute(
            update(RankWindow)
            .where(t.c.run_id == run.id, t.c.rank == p.rank.rank, t.c.window == window)
            .values(**values)
        )

    def _store_windows(self, conn: Connection, run: RunKey, p: IngestPayload) -> None:
        s = p.steps
        w_steps = run.window_steps
        padded = s.padded_tokens
        rows: dict[int, dict[str, Any]] = {}
        for j, dt in enumerate(s.time_s):
            step = s.first + j
            w = (step - 1) // w_steps if step > 0 else 0
            row = rows.get(w)
            if row is None:
                row = rows[w] = {
                    "run_id": run.id,
                    "rank": p.rank.rank,
                    "window": w,
                    "first_step": step,
                    "last_step": step,
                    "n_steps": 0,
                    "step_time_sum": 0.0,
                    "step_time_min": dt,
                    "step_time_max": dt,
                    "data_wait_sum": 0.0,
                    "tokens_sum": 0,
                    "padded_tokens_sum": 0 if padded is not None else None,
                    "wall_end": s.wall_end,
                }
            row["last_step"] = step
            row["n_steps"] += 1
            row["step_time_sum"] += dt
            row["step_time_min"] = min(row["step_time_min"], dt)
            row["step_time_max"] = max(row["step_time_max"], dt)
            row["data_wait_sum"] += s.data_wait_s[j]
            row["tokens_sum"] += s.tokens[j]
            if padded is not None:
                row["padded_tokens_sum"] += padded[j]
        t = RankWindow.__table__
        stmt = self._insert(t)
        ex = stmt.excluded
        stmt = stmt.on_conflict_do_update(
            index_elements=["run_id", "rank", "window"],
            set_={
                "first_step": self._least(t.c.first_step, ex.first_step),
                "last_step": self._greatest(t.c.last_step, ex.last_step),
                "n_steps": t.c.n_steps + ex.n_steps,
                "step_time_sum": t.c.step_time_sum + ex.step_time_sum,
                "step_time_min": self._least(t.c.step_time_min, ex.step_time_min),
                "step_time_max": self._greatest(t.c.step_time_max, ex.step_time_max),
                "data_wait_sum": t.c.data_wait_sum + ex.data_wait_sum,
                "tokens_sum": t.c.tokens_sum + ex.tokens_sum,
                "padded_tokens_sum": func.coalesce(
                    t.c.padded_tokens_sum + ex.padded_tokens_sum, t.c.padded_tokens_sum, ex.padded_tokens_sum
                ),
                "wall_end": self._greatest(t.c.wall_end, ex.wall_end),
            },
        )
        conn.execute(stmt, list(rows.values()))

    def _store_job_steps(self, conn: Connection, run: RunKey, p: IngestPayload) -> None:
        s = p.steps
        counts = p.rank.counts_tokens
        padded = s.padded_tokens
        tags = s.tags
        # Wall-clock end of each step, from the batch's end and the step durations.
        ends = [0.0] * len(s.time_s)
        t_end = s.wall_end
        for j in range(len(s.time_s) - 1, -1, -1):
            ends[j] = t_end
            t_end -= s.time_s[j]
        rows = [
            {
                "run_id": run.id,
                "step": s.first + j,
                "ranks": 1,
                "token_ranks": 1 if counts else 0,
                "step_time_sum": dt,
                "step_time_max": dt,
                "data_wait_max": s.data_wait_s[j],
                "tokens": s.tokens[j] if counts else 0,
                "padded_tokens": (padded[j] if counts else 0) if padded is not None else None,
                "tag": TAG_CODES.get(tags[j] or "", 0) if tags is not None else 0,
                "wall_end": ends[j],
            }
            for j, dt in enumerate(s.time_s)
        ]
        t = JobStep.__table__
        stmt = self._insert(t)
        ex = stmt.excluded
        stmt = stmt.on_conflict_do_update(
            index_elements=["run_id", "step"],
            set_={
                "ranks": t.c.ranks + ex.ranks,
                "token_ranks": t.c.token_ranks + ex.token_ranks,
                "step_time_sum": t.c.step_time_sum + ex.step_time_sum,
                "step_time_max": self._greatest(t.c.step_time_max, ex.step_time_max),
                "data_wait_max": self._greatest(t.c.data_wait_max, ex.data_wait_max),
                "tokens": t.c.tokens + ex.tokens,
                "padded_tokens": func.coalesce(
                    t.c.padded_tokens + ex.padded_tokens, t.c.padded_tokens, ex.padded_tokens
                ),
                "tag": self._greatest(t.c.tag, ex.tag),
                "wall_end": self._greatest(t.c.wall_end, ex.wall_end),
            },
        )
        conn.execute(stmt, rows)
