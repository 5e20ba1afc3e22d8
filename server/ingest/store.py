"""Storing one validated batch: one transaction, idempotent by batch id.

Order inside the transaction: the locks of the job-step buckets its steps fall in
(``storage/rollups.py``), before anything is written; then claim the batch id (a retry
finds it taken and stores nothing), then the rank's latest state, its window summaries
and the job-level per-step rows. Locked first, a group takes its transaction id (at its
first write) only after the writer ahead of it has committed. An id taken before the
wait is older than that commit, and while it is open no session may prune the row
versions that commit replaced: each merge of a ``job_steps`` row then needed room for a
third version, and the table grew to 1.7-2.0x its fresh size in the ingest benchmark
(1.2x locked first; ``storage/postgres.py``). Per-step and per-window rows are merged with
additive upserts, so a window split across batches, or ranks arriving in any order, add
up to the same rows.
The caller answers 2xx only after this commits.

``store_many`` writes a group of batches in one transaction (the group commit that
``group_commit.py`` feeds): the group is folded into one row per key (``fold.py``) and
handed to the backend (``storage/backend.py``), which merges it by the column rules
(``storage/columns.py``); profiler windows follow (``profiles.py``).

Because every group takes the job-step locks first, the groups of all web workers (and
replicas) on one run write one after another, and ingest's throughput is a group's
rank-windows over the time its transaction holds the locks. So that time holds only
what must be inside it: the fold, the statements and their parameters are built before
BEGIN (when every run key is cached, the steady state), and the statements are sent
pipelined (``Storage.pipeline``): under the locks, one round trip for the claim, whose
answer is read, and one for all the merges.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from typing import Any, cast

from sqlalchemy import Connection, Table, or_, select, update

from ..schemas.ingest import IngestPayload, PlanIn
from ..storage import rollups
from ..storage.backend import Storage, Write
from ..storage.models import Run, unix
from . import acks, admission, fold, profiles


@dataclass(frozen=True)
class RunKey:
    """What ingest needs of a run; safe to cache: fixed once the run exists, but for a
    provisional window size, which a writer re-reads when it settles it."""

    id: int
    window_steps: int
    dp_size: int
    world_size: int = 0
    #: The plan as last stored: (target_tokens, deadline Unix s, fingerprint, baseline run).
    plan: tuple[Any, ...] | None = None
    #: The write token that created the run (None: writes were open).
    owner: str | None = None
    #: The window size is a placeholder until a batch shows the run's pace (see
    #: :func:`pace_is_known`); the one cached field that can change, once.
    window_provisional: bool = False


@dataclass(frozen=True)
class _Prepared:
    """A group's run keys (as cached), job-step locks and merges, built before its
    transaction."""

    keys: list[RunKey]
    buckets: tuple[tuple[int, int], ...]
    writes: tuple[Write, ...]


_STAMP_EVERY = timedelta(seconds=1)
_NEVER = datetime.min.replace(tzinfo=timezone.utc)


class _LostRaceError(Exception):
    """Another writer created the run first (its quota increment is rolled back)."""


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


def step_spans(payloads: Sequence[IngestPayload], run_ids: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(run id, first step, last step) of each batch that carries steps."""
    for p, run_id in zip(payloads, run_ids, strict=True):
        if n := len(p.steps.time_s):
            yield run_id, p.steps.first, p.steps.first + n - 1


def _reported(conn: Connection, run_ids: list[int], now: datetime) -> None:
    """Stamp the runs' last report (collector clock), at most once a second per run.

    A run row another transaction holds is skipped (a later group stamps it): the group
    holds its job-step locks by now, and the holder may be a group waiting for them,
    which wrote the row first (a new plan, a settled window size); waiting for it would
    be a deadlock."""
    held_by_none = (
        select(Run.id)
        .where(
            Run.id.in_(run_ids),
            or_(Run.last_report_at.is_(None), Run.last_report_at < now - timedelta(seconds=1)),
        )
        .with_for_update(key_share=True, skip_locked=True)  # FOR NO KEY UPDATE SKIP LOCKED
    )
    conn.execute(update(Run).where(Run.id.in_(held_by_none)).values(last_report_at=now))


def choose_window_steps(
    step_times: Sequence[float],
    window_seconds: float,
    *,
    first: int = 1,
    tags: Sequence[str | None] | None = None,
) -> int:
    """Steps per stored rank window: a power of two near ``window_seconds`` of steps.

    Fixed per run at its first batch, so that every rank's windows cover the same steps
    and can be compared window by window. The pace is the median of the batch's steps
    (``first`` is the number of its first one), leaving out those that say least about it
    when the batch holds others: the run's first step (process-group set-up, DDP's first
    bucket rebuild, the allocator's first requests: 4 s against 0.9-1.6 s steps on a
    loaded host) and tagged steps (warm-up, checkpoint, evaluation). A pace read too slow
    gives windows of fewer steps than ``window_seconds`` means; the late-arrival detector
    pools short windows (``analysis/late_arrivals.py``), so detection holds either way.
    """
    timed = [(first + j, t, tags[j] if tags else None) for j, t in enumerate(step_times) if t > 0]
    if not timed:
        return 1
    later = [x for x in timed if x[0] > 1] or timed
    steady = [t for _, t, tag in later if tag is None] or [t for _, t, _ in later]
    per_step = statistics.median(steady)
    target = max(1.0, window_seconds / per_step)
    return int(min(4096, 2 ** round(math.log2(target))))


def pace_is_known(step_times: Sequence[float], *, first: int = 1) -> bool:
    """Whether a batch tells the run's pace: it holds a step after the first.

    A run's first batch often does not: a heartbeat (no step yet: compilation, a slow
    first bucket rebuild) or the first step alone (it outlasted the send interval). Sized
    from those the windows would hold one step for the whole run (a row per rank per
    step, and detectors fed one step at a time), so such a run's window size stays a
    placeholder, ``provisional``, until a batch that does tell it. Nothing stored
    depends on the placeholder: every window size puts step 1 in window 0, and the first
    batch with a later step settles the size before its rows are folded. (Decided on the
    step numbers, not the times: a later step timed 0 still settles it.) A run resumed
    from a checkpoint starts at a later step, so its first batch always settles it.
    """
    return first + len(step_times) - 1 > 1


class Ingestor:
    """Writes batches; holds a small cache of run keys (never of data)."""

    def __init__(
        self,
        storage: Storage,
        *,
        window_seconds: float = 10.0,
        window_steps: int = 0,
        cache_size: int = 1024,
    ) -> None:
        self.storage = storage
        self.engine = storage.engine
        self.window_seconds = window_seconds
        #: Steps per window of every new run; 0: chosen from its first batch.
        self.window_steps = window_steps
        self._runs: OrderedDict[str, RunKey] = OrderedDict()
        #: When this process last stamped each run's last report: a group within the same
        #: second skips the statement (a round trip per group) that would change nothing.
        self._stamped: dict[int, datetime] = {}
        self._cache_size = cache_size
        self._lock = threading.Lock()

    # -- runs ----------------------------------------------------------------------
    def cached(self, name: str) -> RunKey | None:
        """The run's key if it is in the cache; never touches the database."""
        with self._lock:
            return self._runs.get(name)

    def admit(self, p: IngestPayload, owner: str | None, limit: int) -> RunKey:
        """The key of run ``p.run``, created (from this, its first batch) if it is new and
        ``owner`` has a run left in its quota; raises :class:`QuotaExceededError` if not.
        Ownership and world size are the caller's to check against the key."""
        key = self.cached(p.run)
        if key is not None:
            return key
        try:
            with self.engine.begin() as conn:
                key = self._select_key(conn, p.run)
                if key is None:
                    admission.take_run(conn, self.storage.insert, owner, limit)
                    runs = cast(Table, Run.__table__)
                    created = conn.execute(
                        self.storage.insert(runs)
                        .values(**self._new_run(p, _plan_row(p.plan), owner))
                        .on_conflict_do_nothing(index_elements=["name"])
                        .returning(runs.c.id)
                    ).first()
                    if created is None:
                        raise _LostRaceError
                    key = self._select_key(conn, p.run)
        except _LostRaceError:
            key = None
        if key is None:
            with self.engine.connect() as conn:
                key = self._select_key(conn, p.run)
            assert key is not None, "a run that won the race is committed"
        self._remember(p.run, key)
        return key

    def _run_key(self, conn: Connection, p: IngestPayload, owner: str | None = None) -> RunKey:
        with self._lock:
            key = self._runs.get(p.run)
            if key is not None:
                self._runs.move_to_end(p.run)
        plan = _plan_row(p.plan)
        wanted = None if plan is None else _plan_key(*plan.values())
        if key is not None and key.window_provisional:
            settled = self._settle_window(conn, p, key)
            if settled != key:
                key = settled
                self._remember(p.run, key)  # forgotten again if the group rolls back
        if key is not None and (wanted is None or key.plan == wanted):
            return key
        if key is None:
            key = self._settle_window(conn, p, self._load_run(conn, p, plan, owner))
        if plan is not None and key.plan != wanted:
            # Written only when it changes (once per run and replica), not per batch.
            conn.execute(update(Run).where(Run.id == key.id).values(**plan))
            key = replace(key, plan=wanted)
        self._remember(p.run, key)
        return key

    def _settle_window(self, conn: Connection, p: IngestPayload, key: RunKey) -> RunKey:
        """Fix a provisional window size from the first batch that shows the run's pace.

        The update is conditional, so concurrent writers (other groups, other replicas)
        settle it once: a writer that loses re-reads the winner's size.
        """
        if not key.window_provisional or not pace_is_known(p.steps.time_s, first=p.steps.first):
            return key
        runs = cast(Table, Run.__table__)
        conn.execute(
            update(runs)
            .where(runs.c.id == key.id, runs.c.window_provisional.is_(True))
            .values(window_steps=self._chosen_window_steps(p), window_provisional=False)
        )
        settled = self._select_key(conn, p.run)
        assert settled is not None, "the run exists"
        return settled

    def _remember(self, name: str, key: RunKey) -> None:
        with self._lock:
            self._runs[name] = key
            while len(self._runs) > self._cache_size:
                self._runs.popitem(last=False)

    def _load_run(
        self, conn: Connection, p: IngestPayload, plan: dict[str, Any] | None, owner: str | None
    ) -> RunKey:
        key = self._select_key(conn, p.run)
        if key is None:  # stored without the API's admission (tools, tests)
            stmt = self.storage.insert(cast(Table, Run.__table__)).values(**self._new_run(p, plan, owner))
            conn.execute(stmt.on_conflict_do_nothing(index_elements=["name"]))
            key = self._select_key(conn, p.run)
            assert key is not None
        return key

    def _chosen_window_steps(self, p: IngestPayload) -> int:
        s = p.steps
        return choose_window_steps(s.time_s, self.window_seconds, first=s.first, tags=s.tags)

    def _window(self, p: IngestPayload) -> dict[str, Any]:
        """A new run's window size: the setting's, else chosen from the batch's pace, else
        a provisional placeholder until a batch shows the pace."""
        if self.window_steps:
            return {"window_steps": self.window_steps, "window_provisional": False}
        if not pace_is_known(p.steps.time_s, first=p.steps.first):
            return {"window_steps": 1, "window_provisional": True}
        return {"window_steps": self._chosen_window_steps(p), "window_provisional": False}

    def _new_run(self, p: IngestPayload, plan: dict[str, Any] | None, owner: str | None) -> dict[str, Any]:
        """The run's row, from its first batch."""
        return {
            "name": p.run,
            "world_size": p.rank.world_size,
            "dp_size": p.rank.layout.dp,
            "layout": p.rank.layout.model_dump(),
            "convention": p.convention.model_dump() if p.convention else None,
            **self._window(p),
            "created_at": datetime.now(timezone.utc),
            "created_by": owner,
            **(plan or {}),
        }

    @staticmethod
    def _select_key(conn: Connection, name: str) -> RunKey | None:
        runs = cast(Table, Run.__table__)
        row = conn.execute(
            select(
                runs.c.id,
                runs.c.window_steps,
                runs.c.dp_size,
                runs.c.world_size,
                runs.c.target_tokens,
                runs.c.deadline,
                runs.c.config_fingerprint,
                runs.c.baseline_run,
                runs.c.created_by,
                runs.c.window_provisional,
            ).where(runs.c.name == name)
        ).first()
        if row is None:
            return None
        return RunKey(
            id=row.id,
            window_steps=row.window_steps,
            dp_size=row.dp_size,
            world_size=row.world_size,
            plan=_plan_key(row.target_tokens, row.deadline, row.config_fingerprint, row.baseline_run),
            owner=row.created_by,
            window_provisional=bool(row.window_provisional),
        )

    def _stamp(self, conn: Connection, run_ids: list[int]) -> None:
        now = datetime.now(timezone.utc)
        with self._lock:
            due = [r for r in run_ids if now - self._stamped.get(r, _NEVER) >= _STAMP_EVERY]
            if len(self._stamped) > 4 * self._cache_size:
                self._stamped.clear()
            for r in due:  # a group that rolls back leaves its stamp to a group a second later
                self._stamped[r] = now
        if due:
            _reported(conn, due, now)

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
        first: dict[tuple[str, str], int] = {}  # batch ids are unique per run
        for i, p in enumerate(payloads):
            first.setdefault((p.run, p.batch_id), i)
        unique = [payloads[i] for i in first.values()]
        owner_of = [owners[i] if owners is not None else None for i in first.values()]
        # Folded, and the statements built, before the transaction when every run's key is
        # cached (the steady state): the groups of all web workers write one after another
        # (each holds the job-step locks from its first statement to its commit), so the
        # group's Python work done in its transaction was everyone's wait. Refolded inside
        # only if some batch turns out to be a retry.
        cached = self._cached_keys(unique)
        prepared = None
        if cached is not None:
            run_ids = [k.id for k in cached]
            prepared = _Prepared(
                cached,
                tuple(rollups.buckets_of(step_spans(unique, run_ids))),
                self.storage.prepare(fold.fold(unique, run_ids, [k.window_steps for k in cached])),
            )
        try:
            fresh = self._write_group(unique, owner_of, prepared)
        except BaseException:
            # A key cached inside the rolled-back transaction (a settled window size, a
            # plan) may not be what the database holds: read those runs again next time.
            self._forget({p.run for p in unique})
            raise
        stored = {(p.run, p.batch_id) for p, _ in fresh}
        return [
            i == first[p.run, p.batch_id] and (p.run, p.batch_id) in stored for i, p in enumerate(payloads)
        ]

    def _write_group(
        self,
        unique: Sequence[IngestPayload],
        owner_of: Sequence[str | None],
        prepared: _Prepared | None,
    ) -> list[tuple[IngestPayload, RunKey]]:
        """The group's transaction; returns the batches it stored (not retries), with keys.
        ``prepared``: every batch's run key, as :meth:`_run_key` gives it without the
        database (:meth:`_cached_keys`), with the group's locks and merges built from it."""
        with self.engine.begin() as conn:
            if prepared is not None:
                keys, buckets = prepared.keys, prepared.buckets
            else:
                keys = [self._run_key(conn, p, o) for p, o in zip(unique, owner_of, strict=True)]
                buckets = tuple(rollups.buckets_of(step_spans(unique, [k.id for k in keys])))
            # Pipelined while the group holds the locks every other group waits for: under
            # them, one round trip for the claim's answer and one for the rest.
            with self.storage.pipeline(conn):
                # The job-step locks before the first row is written (the module docstring).
                self.storage.lock_buckets(conn, buckets)
                new = self.storage.claim(conn, unique, [k.id for k in keys])
                fresh = [(p, k) for p, k in zip(unique, keys, strict=True) if (k.id, p.batch_id) in new]
                if fresh:
                    self._stamp(conn, sorted({k.id for _, k in fresh}))
                    if prepared is not None and len(fresh) == len(unique):
                        writes = prepared.writes
                    else:
                        batches, ks = [p for p, _ in fresh], [k for _, k in fresh]
                        rows = fold.fold(batches, [k.id for k in ks], [k.window_steps for k in ks])
                        writes = self.storage.prepare(rows)
                    self.storage.write(conn, writes)
            if fresh:  # these read: after the pipeline
                for p, k in fresh:  # profiler windows and directive answers: a few batches in a thousand
                    if p.profiles:
                        profiles.store(conn, self.storage, k.id, k.window_steps, k.world_size, p)
                    if p.acks or p.profiles:
                        acks.store(conn, self.storage, k.id, p)
        return fresh

    def _forget(self, runs: Iterable[str]) -> None:
        with self._lock:
            for name in runs:
                self._runs.pop(name, None)

    def _cached_keys(self, payloads: Sequence[IngestPayload]) -> list[RunKey] | None:
        """Every payload's run key as ``_run_key`` would return it without the database,
        or None if one is not cached, its window size is still provisional (the group may
        settle it) or its plan would be written."""
        keys = []
        with self._lock:
            for p in payloads:
                key = self._runs.get(p.run)
                if key is None or key.window_provisional:
                    return None
                if p.plan is not None and key.plan != _plan_key(*(_plan_row(p.plan) or {}).values()):
                    return None
                keys.append(key)
            for name in {p.run for p in payloads}:  # recently used, as ``_run_key`` marks them
                self._runs.move_to_end(name)
        return keys
