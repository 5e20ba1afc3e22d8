"""Every road to a stored row gives the same row: a property test of the column rules.

Random runs (ranks, batch boundaries, step times, tokens, padding, tags, profiled
windows with their wait/transfer split) are stored on SQLite and on PostgreSQL, each in
its own random order and grouping (so one backend folds with numpy what the other merges
by upserts), then rolled up by retention. The rows must agree between the backends after
ingest and after the rollup, the job-level rows must be the sums of what was sent, and
the rollup must keep every total. Values are multiples of 1/64 s so that sums in any
order are exact; means (divisions) are compared to 1e-9.
"""

from __future__ import annotations

import math
import random
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, select

from stepwatch_server.ingest.store import Ingestor, pace_is_known
from stepwatch_server.reads.runs import run_info
from stepwatch_server.schemas.ingest import IngestPayload
from stepwatch_server.storage import migrate, rollups
from stepwatch_server.storage.backend import Storage, open_storage
from stepwatch_server.storage.columns import (
    JOB_STEP_BUCKETS,
    JOB_STEPS,
    RANK_GROUPS,
    RANK_WINDOWS,
    RANKS,
    STEP_TIMINGS,
    Summed,
    window_of,
)
from stepwatch_server.storage.engine import make_engine
from stepwatch_server.storage.models import Run, unix
from stepwatch_server.storage.retention import prune
from stepwatch_server.worker import inputs

from .. import pg
from ..payloads import payload, profile_entry

#: What :func:`runs` draws.
Run_ = tuple[list[dict[str, Any]], list[dict[str, Any]], dict[int, list[float]], dict[int, dict[str, int]]]
T0 = 1.7e9  # the runs' wall clock: long enough ago for retention to roll everything up
TAGS = (None, None, None, "warmup", "checkpoint", "eval")


@pytest.fixture
def storages(pg_admin: str, tmp_path: Path) -> Iterator[tuple[Storage, Storage]]:
    with ExitStack() as stack:
        urls = [f"sqlite:///{tmp_path / 'rules.db'}", stack.enter_context(pg.fresh_database(pg_admin))]
        engines: list[Engine] = []
        for url in urls:
            migrate.upgrade(url)
            engines.append(make_engine(url))
            stack.callback(engines[-1].dispose)
        yield open_storage(engines[0]), open_storage(engines[1])


@st.composite
def runs(draw: st.DrawFn) -> Run_:
    """(step batches, final batches with the profiled windows, step times per step,
    the largest ``entered`` per rank and process group)."""
    name = f"rules-{uuid.uuid4().hex[:12]}"
    world = draw(st.integers(1, 3))
    n = draw(st.integers(1, 24))
    base = draw(st.sampled_from([0, 50, 120]))  # runs across the job-step buckets' edges
    sixty4ths = st.integers(16, 64).map(lambda k: k / 64)
    steps: list[dict[str, Any]] = []
    per_step: dict[int, list[float]] = {}
    counters: dict[int, dict[str, int]] = {}
    for rank in range(world):
        cuts = sorted(draw(st.sets(st.integers(2, n), max_size=4))) if n > 1 else []
        for lo, hi in zip([1, *cuts], [*cuts, n + 1], strict=True):
            times = draw(st.lists(sixty4ths, min_size=hi - lo, max_size=hi - lo))
            # Collective counters: they grow with the steps; what else a rank says of a
            # group is the same in each of its batches (the backends store them in
            # different orders, and those columns keep the last).
            entered = 3 * hi + draw(st.integers(0, 2))
            groups = [
                {"group": g, "entered": entered, "completed": entered - draw(st.integers(0, 2)), "op": op}
                | ({"since": T0 + rank} if rank % 2 else {})
                for g, op in (("world", "all_reduce"), (f"pp{rank % 2}", "send"))[: draw(st.integers(0, 2))]
            ]
            mine = counters.setdefault(rank, {})
            for g in groups:
                mine[g["group"]] = max(g["entered"], mine.get(g["group"], 0))
            padded = draw(st.booleans())
            tokens = draw(st.lists(st.integers(0, 4096), min_size=hi - lo, max_size=hi - lo))
            steps.append(
                payload(
                    run=name,
                    rank=rank,
                    world=world,
                    first=base + lo,
                    times=times,
                    waits=[t / 4 for t in times],
                    tokens=tokens,
                    padded=[t + 64 for t in tokens] if padded else None,
                    tags=draw(st.lists(st.sampled_from(TAGS), min_size=hi - lo, max_size=hi - lo)),
                    wall_end=T0 + hi,
                    comm=_comm(hi - lo, groups) if groups else None,
                )
            )
            for j, t in enumerate(times):
                per_step.setdefault(base + lo + j, []).append(t)
    # Profiled windows: the same steps on every rank (as the agent aligns them).
    profiled = sorted(draw(st.sets(st.integers(1, n), max_size=3)))
    finals = []
    for rank in range(world):
        entries = []
        for first in profiled:
            k = draw(st.integers(1, min(4, n - first + 1)))
            compute = draw(st.integers(4, 12)) / 64
            enter = [float(j) + draw(st.integers(0, 8)) / 64 for j in range(k)]
            entries.append(
                profile_entry(
                    first_step=base + first,
                    enter=enter,
                    end=[e + 1 / 64 for e in enter],
                    compute=compute,
                    ranks=list(range(world)),
                    t0=T0,
                )
            )
        finals.append(
            payload(
                run=name,
                rank=rank,
                world=world,
                first=base + n + 1,
                times=[],
                final=True,
                profiles=entries or None,
                wall_end=T0 + n,
            )
        )
    return steps, finals, per_step, counters


def _comm(n: int, groups: list[dict[str, Any]]) -> dict[str, Any]:
    none: list[float | None] = [None] * n
    return {"version": 1, "arrive_s": none, "end_s": none, "sync_s": none, "cpu_s": none, "groups": groups}


def _rows(storage: Storage, run: str) -> dict[str, list[dict[str, Any]]]:
    with storage.engine.connect() as conn:
        run_id = conn.execute(select(Run.id).where(Run.name == run)).scalar_one()
        out = {}
        for table in (RANKS, RANK_WINDOWS, JOB_STEPS, JOB_STEP_BUCKETS, RANK_GROUPS):
            t = table.table
            q = select(t).where(t.c.run_id == run_id).order_by(*(t.c[k] for k in table.keys))
            out[table.name] = [_plain(dict(r._mapping)) for r in conn.execute(q)]
        return out


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    row.pop("run_id")
    for k, v in row.items():
        if isinstance(v, datetime):  # SQLite returns naive UTC
            row[k] = unix(v)
    return row


def _same(a: dict[str, list[dict[str, Any]]], b: dict[str, list[dict[str, Any]]]) -> None:
    for table in a:
        assert len(a[table]) == len(b[table]), table
        for x, y in zip(a[table], b[table], strict=True):
            assert x.keys() == y.keys()
            for k in x:
                if isinstance(x[k], float) or isinstance(y[k], float):
                    assert x[k] == pytest.approx(y[k], rel=1e-9), (table, k, x, y)
                else:
                    assert x[k] == y[k], (table, k, x, y)


def _store(storage: Storage, batches: list[dict[str, Any]], rnd: random.Random, *, first: bool) -> None:
    """Store ``batches`` in a random order and grouping; ``first``: the batches that fix
    the run's window size go first, alone and in their order, so that it is the same on
    both sides: up to the first that shows the pace (a step after the first; a batch of
    step 1 alone leaves the size provisional, and shuffled, a different batch on each
    backend settled it: 4-step windows on one, 8 on the other)."""
    ingestor = Ingestor(storage, window_seconds=2.0)
    rest = list(batches)
    while first and rest:
        p = IngestPayload.model_validate(rest.pop(0))
        assert ingestor.store_many([p]) == [True]
        first = not pace_is_known(p.steps.time_s, first=p.steps.first)
    rnd.shuffle(rest)
    while rest:
        k = rnd.randint(1, len(rest))
        assert all(ingestor.store_many([IngestPayload.model_validate(b) for b in rest[:k]]))
        rest = rest[k:]


def _totals(rows: list[dict[str, Any]], *cols: str) -> list[float]:
    return [sum(r[c] or 0 for r in rows) for c in cols]


def test_random_groups_give_the_same_rows_on_both_backends_and_after_rollup(
    storages: tuple[Storage, Storage],
) -> None:
    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(runs(), st.randoms(use_true_random=False))
    def check(run: Run_, rnd: random.Random) -> None:
        steps, finals, per_step, counters = run
        name = steps[0]["run"]
        for storage in storages:
            _store(storage, steps, rnd, first=True)
            # Profiles after the steps they describe, in any order and grouping.
            _store(storage, finals, rnd, first=False)
        sqlite, postgres = (_rows(s, name) for s in storages)
        _same(sqlite, postgres)
        jobs = sqlite["job_steps"]
        assert [j["step"] for j in jobs] == sorted(per_step)
        assert [j["ranks"] for j in jobs] == [len(per_step[j["step"]]) for j in jobs]
        assert [j["step_time_sum"] for j in jobs] == [sum(per_step[j["step"]]) for j in jobs]
        assert [j["step_time_max"] for j in jobs] == [max(per_step[j["step"]]) for j in jobs]
        groups = sqlite["rank_groups"]
        assert {(g["rank"], g["group_name"]): g["entered"] for g in groups} == {
            (r, name): e for r, by in counters.items() for name, e in by.items()
        }
        # The buckets ingest kept are the buckets recomputed from the stored steps.
        buckets = sqlite["job_step_buckets"]
        usable = [j for j in jobs if j["token_ranks"] > 0 and j["step_time_sum"] > 0]
        assert [b["bucket"] for b in buckets] == sorted({(j["step"] - 1) // 64 for j in usable})
        assert sum(b["n_steps"] for b in buckets) == len(usable)
        st_sum = sum(j["step_time_sum"] / j["ranks"] for j in usable)
        assert sum(b["step_time_sum"] for b in buckets) == pytest.approx(st_sum, rel=1e-9)
        for storage in storages:
            with storage.engine.begin() as conn:
                rollups.rebuild(conn, storage.insert)
        _same(sqlite, _rows(storages[0], name))
        _same(postgres, _rows(storages[1], name))

        sums = ("n_steps", "step_time_sum", "tokens_sum", "padded_tokens_sum", "profiled_steps", "skew_steps")
        before = _totals(sqlite["rank_windows"], *sums)
        for storage in storages:
            prune(storage, full_days=2, factor=2, batch_id_days=7, now=T0 + 30 * 86400)
        sqlite, postgres = (_rows(s, name) for s in storages)
        _same(sqlite, postgres)
        assert _totals(sqlite["rank_windows"], *sums) == before
        assert sqlite["job_step_buckets"] == buckets  # retention keeps the buckets

    check()


def test_every_column_of_the_summed_tables_has_a_rule() -> None:
    tables: tuple[Summed, ...] = (RANKS, RANK_WINDOWS, JOB_STEPS, JOB_STEP_BUCKETS, STEP_TIMINGS, RANK_GROUPS)
    for table in tables:
        assert {c.name for c in table.table.columns} == {c.name for c in table.columns}, table.name
        assert set(table.keys) == {c.name for c in table.table.primary_key}, table.name


def test_staged_steps_two_batches_carry_are_the_later_sents_on_both_backends(
    storages: tuple[Storage, Storage],
) -> None:
    """A rank's batches carrying the same steps (an agent restarted from a checkpoint, a
    stale batch retried late): random spans (many from the same first step, of other
    lengths), sent in a random order of ``sent_at``, stored in random groups on each
    backend. Each step must read back as the batch sent last among those carrying it,
    whether they merged in one group (the fold), in the database (the upsert of the same
    first step) or in the reader (rows from different first steps)."""
    rnd = random.Random(11)
    for trial in range(6):
        name = f"overlap-{trial}"
        spans = [(rnd.choice((1, 1, 5, 9)), rnd.randint(1, 12)) for _ in range(10)]
        order = list(range(len(spans)))
        rnd.shuffle(order)  # sent_at order differs from storing order
        batches = []
        for i, (first, n) in enumerate(spans):
            tag = float(i + 1)
            comm = {
                "version": 1,
                "arrive_s": [None] * n,
                "end_s": [None] * n,
                "sync_s": [tag / 8 if (first + j) % 3 else None for j in range(n)],
                "cpu_s": [tag / 16] * n,
            }
            b = payload(run=name, first=first, times=[tag + j / 64 for j in range(n)], comm=comm, wall_end=T0)
            b["sent_at"] = T0 + order[i]
            batches.append(b)
        expected: dict[int, tuple[float, float | None]] = {}
        for i in sorted(range(len(spans)), key=lambda i: order[i]):  # in sent order: the last wins
            first, n = spans[i]
            for j in range(n):
                step = first + j
                expected[step] = (i + 1 + j / 64, (i + 1) / 8 if step % 3 else None)
        for storage in storages:
            ingestor = Ingestor(storage, window_steps=4)
            rest = list(batches)
            rnd.shuffle(rest)
            while rest:
                k = rnd.randint(1, 3)
                assert all(ingestor.store_many([IngestPayload.model_validate(b) for b in rest[:k]]))
                rest = rest[k:]
            with storage.engine.connect() as conn:
                run = run_info(conn.execute(select(Run.__table__).where(Run.name == name)).one())
                ranks = inputs.rank_rows(conn, run.id)
                got = inputs.step_timings(conn, run, ranks, 0, window_of(max(expected), 4))
            read = {
                rs.first_step + j: (float(t), None if math.isnan(sync) else float(sync))
                for window in got.values()
                for rs in window
                for j, (t, sync) in enumerate(zip(rs.step_time_s, rs.sync_s, strict=True))
            }
            assert read == expected, (storage.engine.url, spans, order)
