"""Storing one validated batch: one transaction, idempotent by batch id.

Order inside the transaction: claim the batch id first (a retry finds it taken and
stores nothing), then the rank's latest state, its window summaries and the job-level
per-step rows. Per-step and per-window rows are merged with additive upserts, so a
window split across batches, or ranks arriving in any order, add up to the same rows.
The caller answers 2xx only after this commits.

``store_many`` writes a group of batches in one transaction (the group commit that
``group_commit.py`` feeds): the group is folded into one row per key (``fold.py``) and
handed to the backend (``storage/backend.py``), which merges it by the column rules
(``storage/columns.py``); profiler windows follow (``profiles.py``).
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any, cast

from sqlalchemy import Connection, Table, func, select, update

from ..schemas.ingest import IngestPayload, PlanIn
from ..storage.backend import Storage
from ..storage.models import Run, unix
from . import fold, profiles


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
    when = unix(deadline)
    when = None if when is None else round(when, 3)
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

    def __init__(self, storage: Storage, *, window_seconds: float = 10.0, cache_size: int = 1024) -> None:
        self.storage = storage
        self.engine = storage.engine
        self.window_seconds = window_seconds
        self._runs: OrderedDict[str, RunKey] = OrderedDict()
        self._admitted: OrderedDict[str, None] = OrderedDict()  # new runs past the quota check
        self._cache_size = cache_size
        self._lock = threading.Lock()

    # -- runs ----------------------------------------------------------------------
    def knows_run(self, name: str) -> bool:
        """True if the run is in the cache (it exists) or was admitted; never touches the
        database."""
        with self._lock:
            return name in self._runs or name in self._admitted

    def admits_run(self, name: str, owner: str | None, limit: int) -> int | None:
        """None if a batch of run ``name`` from ``owner`` may be stored; else how many runs
        ``owner`` has created already (at or past ``limit``). Only a new run is counted."""
        with self._lock:
            if name in self._runs:
                return None
        runs = Run.__table__
        with self.engine.connect() as conn:
            if conn.execute(select(runs.c.id).where(runs.c.name == name)).first() is not None:
                return None
            mine = runs.c.created_by.is_(None) if owner is None else runs.c.created_by == owner
            count = int(conn.execute(select(func.count()).select_from(runs).where(mine)).scalar_one())
        if count >= limit:
            return count
        with self._lock:  # its next batches need no check (until the run is cached)
            self._admitted[name] = None
            while len(self._admitted) > self._cache_size:
                self._admitted.popitem(last=False)
        return None

    def _run_key(self, conn: Connection, p: IngestPayload, owner: str | None = None) -> RunKey:
        with self._lock:
            key = self._runs.get(p.run)
            if key is not None:
                self._runs.move_to_end(p.run)
        plan = _plan_row(p.plan)
        wanted = None if plan is None else _plan_key(*plan.values())
        if key is not None and (wanted is None or key.plan == wanted):
            return key
        if key is None:
            key = self._load_run(conn, p, plan, owner)
        if plan is not None and key.plan != wanted:
            # Written only when it changes (once per run and replica), not per batch.
            conn.execute(update(Run).where(Run.id == key.id).values(**plan))
            key = replace(key, plan=wanted)
        with self._lock:
            self._runs[p.run] = key
            while len(self._runs) > self._cache_size:
                self._runs.popitem(last=False)
        return key

    def _load_run(
        self, conn: Connection, p: IngestPayload, plan: dict[str, Any] | None, owner: str | None
    ) -> RunKey:
        runs = cast(Table, Run.__table__)
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
            stmt = self.storage.insert(runs).values(
                name=p.run,
                world_size=p.rank.world_size,
                dp_size=p.rank.layout.dp,
                layout=p.rank.layout.model_dump(),
                convention=p.convention.model_dump() if p.convention else None,
                window_steps=choose_window_steps(p.steps.time_s, self.window_seconds),
                created_at=datetime.now(timezone.utc),
                created_by=owner,
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
        return self.store_many([p])[0]

    def store_many(
        self, payloads: Sequence[IngestPayload], owners: Sequence[str | None] | None = None
    ) -> list[bool]:
        """Store a group of batches in one transaction. For each batch: True if stored,
        False if its id was stored before (or earlier in the same group). Raises on DB
        errors, and then nothing of the group is stored. ``owners`` names the write token
        of each batch (recorded on a run the batch creates)."""
        first: dict[str, int] = {}
        for i, p in enumerate(payloads):
            first.setdefault(p.batch_id, i)
        unique = [payloads[i] for i in first.values()]
        owner_of = [owners[i] if owners is not None else None for i in first.values()]
        with self.engine.begin() as conn:
            keys = [self._run_key(conn, p, o) for p, o in zip(unique, owner_of, strict=True)]
            run_ids = [k.id for k in keys]
            new = self.storage.claim(conn, unique, run_ids)
            fresh = [(p, k) for p, k in zip(unique, keys, strict=True) if p.batch_id in new]
            if fresh:
                rows = fold.fold(
                    [p for p, _ in fresh], [k.id for _, k in fresh], [k.window_steps for _, k in fresh]
                )
                self.storage.write(conn, rows)
                for p, k in fresh:  # profiler windows: a few batches in a thousand
                    profiles.store(conn, self.storage, k.id, k.window_steps, k.world_size, p)
        return [i == first[p.batch_id] and p.batch_id in new for i, p in enumerate(payloads)]
