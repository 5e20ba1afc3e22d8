"""The analysis worker over a real database (SQLite and PostgreSQL): windows in, events out.

Batches go in through the real API (in process); the worker's passes are run by the test
(``run_once``) with an injected clock where time matters (grace, hangs).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Connection, Engine, select

from stepwatch_server.analysis.arrivals import RankSteps
from stepwatch_server.analysis.pipeline import Change, RunAnalysis
from stepwatch_server.analysis.progress import SECONDS_PER_DAY
from stepwatch_server.analysis.types import RankWindow as RankWindowIn
from stepwatch_server.app import create_app
from stepwatch_server.reads.runs import run_info
from stepwatch_server.settings import Settings
from stepwatch_server.storage import packed
from stepwatch_server.storage.backend import open_storage
from stepwatch_server.storage.columns import STEP_TIMING_VALUES
from stepwatch_server.storage.engine import make_engine
from stepwatch_server.storage.models import JobStep, Rank, RankWindow, Run, StepTiming
from stepwatch_server.worker import AnalysisWorker, WorkerConfig, inputs, outputs

from .. import pg
from ..payloads import payload, profile_entry

W = 8  # ranks
STEPS = 8  # steps per window (window_seconds 4 / 0.5 s steps)


class Clock:
    def __init__(self) -> None:
        self.t = time.time()

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def client(db_url: str, engine: Engine) -> Iterator[TestClient]:
    app = create_app(Settings(database_url=db_url, window_seconds=4.0, analysis_enabled=False), engine=engine)
    with TestClient(app) as c:
        yield c


def post(client: TestClient, **kw: Any) -> None:
    r = client.post("/api/v1/ingest", json=payload(**kw))
    assert r.status_code == 200, r.text


def send_windows(
    client: TestClient,
    windows: range,
    *,
    run: str = "test-run",
    slow_rank: int | None = None,
    slow_from: int = 0,
    slow_to: int = 10**9,
    final_at: int | None = None,
    ranks: range = range(W),
    world: int = W,
    step_s: float = 0.5,
    **kw: Any,
) -> None:
    """Windows of STEPS steps for each rank; ``slow_rank``'s loader waits 0.1 s more per step."""
    for w in windows:
        for r in ranks:
            slow = r == slow_rank and slow_from <= w < slow_to
            waits = [0.001 + 0.0001 * ((r * 7 + j) % 5) + (0.1 if slow else 0.0) for j in range(STEPS)]
            post(
                client,
                run=run,
                rank=r,
                world=world,
                first=w * STEPS + 1,
                times=[step_s] * STEPS,
                waits=waits,
                final=w == final_at,
                **kw,
            )


def worker(engine: Engine, clock: Clock | None = None, **cfg: Any) -> AnalysisWorker:
    return AnalysisWorker(open_storage(engine), WorkerConfig(**cfg), clock=clock or time.time)


def events(client: TestClient, run: str = "test-run", **params: str) -> list[dict[str, Any]]:
    return client.get(f"/api/v1/runs/{run}/events", params=params).json()  # type: ignore[no-any-return]


def test_straggler_opens_and_closes_once_across_passes_and_replicas(
    client: TestClient, engine: Engine
) -> None:
    send_windows(client, range(0, 9), slow_rank=3, slow_from=4, slow_to=12)
    first = worker(engine).run_once()
    assert first.windows == 8  # window 8 holds the newest steps: not complete yet
    [(run, opened)] = first.transitions
    assert (run, opened.finding.key, opened.finding.status) == ("test-run", "straggler:data:rank=3", "open")
    assert worker(engine).run_once().transitions == []  # a replayed pass changes nothing

    # Another worker instance (a replica, or a restart) continues from the stored state.
    send_windows(client, range(9, 18), slow_rank=3, slow_from=4, slow_to=12, final_at=17)
    later = worker(engine).run_once()
    assert later.windows == 10  # 8..17, the last one complete because every rank finished
    assert [t.finding.status for _, t in later.transitions] == ["closed"]
    (ev,) = events(client)
    assert (ev["key"], ev["cause"], ev["ranks"], ev["hosts"], ev["status"]) == (
        "straggler:data:rank=3",
        "data",
        [3],
        ["node0"],
        "closed",
    )
    assert ev["first_step"] == 4 * STEPS + 1 and ev["last_step"] == 12 * STEPS
    assert ev["evidence"]["opened_window"] == 6 and ev["evidence"]["windows_flagged"] == 8
    assert ev["cost_seconds"] == pytest.approx(0.1, rel=0.05)
    assert ev["cost_ratio"] == pytest.approx(0.2, rel=0.05)
    assert ev["message"].startswith("Rank 3 (host node0) was a data straggler from step 33 to 96")
    ov = client.get("/api/v1/runs/test-run").json()
    assert ov["analysis"]["windows_analysed"] == 18 and ov["analysis"]["analysed_through_step"] == 144
    assert not events(client, kind="hang")


def test_a_late_rank_is_waited_for_then_left_out(client: TestClient, engine: Engine) -> None:
    clock = Clock()
    send_windows(client, range(0, 2))
    send_windows(client, range(2, 7), ranks=range(W - 1))  # rank 7 stopped reporting after window 1
    w = worker(engine, clock, grace_s=60.0)
    assert w.run_once().windows == 2
    clock.t += 30
    assert w.run_once().windows == 0  # still within the grace period
    clock.t += 31
    assert w.run_once().windows == 4  # windows 2-5 without rank 7; window 6 is still open
    ov = client.get("/api/v1/runs/test-run").json()
    assert ov["analysis"]["windows_analysed"] == 6


def _profiled(window: int, rank: int, slow_rank: int, slow: range) -> dict[str, Any]:
    """The profiler entry of ``window``'s first two steps (rank ``slow_rank`` computes
    0.13 s more per step in the windows ``slow``)."""
    compute = 0.38 if rank == slow_rank and window in slow else 0.25
    return profile_entry(
        first_step=window * STEPS + 1, enter=[0.4, 0.9], end=[0.45, 0.95], compute=compute, ranks=None
    )


def test_a_window_is_compared_once_its_ranks_profiles_are_in(client: TestClient, engine: Engine) -> None:
    """As in the agent under load: a profiler entry is parsed on the profiler thread and
    rides on a later batch than its steps, here two batches later, and each batch says
    through which step the rank owes no entry. A pass between a window's steps and its
    profiles leaves the window for a later pass, so every profiled window reaches the
    straggler detector with its compute times: rank 2's extra compute (windows 2-5) opens a
    flag, which closes once it is gone. Compared as soon as the steps were in (without
    ``profiles_through``), no window had its profiles, and no flag opened."""
    ranks, slow = range(4), range(2, 6)
    w = worker(engine)
    found: list[tuple[str, str, int]] = []
    for win in range(12):
        for r in ranks:
            post(
                client,
                rank=r,
                world=4,
                first=win * STEPS + 1,
                times=[0.5] * STEPS,
                profiles=[_profiled(win - 2, r, 2, slow)] if win >= 2 else None,
                # The entries of the last two windows (their first two steps) are owed.
                profiles_through=max(0, (win - 1) * STEPS),
            )
        result = w.run_once()
        assert result.windows == (1 if win >= 2 else 0), "only the window whose profiles came"
        found += [(t.finding.key, t.finding.status, win - 2) for _, t in result.transitions]
    assert found == [("straggler:compute:rank=2", "open", 4), ("straggler:compute:rank=2", "closed", 8)]
    with engine.connect() as conn:
        through = conn.execute(select(Rank.__table__.c.profiles_through)).scalars().all()
    assert through == [10 * STEPS] * 4
    # An older batch arriving late (a retry that outlived newer batches) does not move it
    # back, and a batch that says nothing (a heartbeat) leaves it as it is.
    post(client, rank=1, world=4, first=1, times=[0.5] * STEPS, profiles_through=0)
    post(client, rank=2, world=4, first=12 * STEPS + 1, times=[0.5] * STEPS)
    with engine.connect() as conn:
        rows = conn.execute(select(Rank.__table__).where(Rank.__table__.c.rank.in_([1, 2]))).all()
    assert [(r.profiles_through, r.last_step) for r in rows] == [
        (10 * STEPS, 12 * STEPS),
        (10 * STEPS, 13 * STEPS),
    ]


def test_a_profile_never_sent_holds_its_window_for_the_grace_only(client: TestClient, engine: Engine) -> None:
    clock = Clock()
    for win in range(3):
        for r in range(4):
            # Rank 3's profile of step 9 never comes (its profiler thread is stuck).
            owed = 8 if r == 3 else win * STEPS + STEPS
            post(client, rank=r, world=4, first=win * STEPS + 1, times=[0.5] * STEPS, profiles_through=owed)
    w = worker(engine, clock, grace_s=60.0)
    assert w.run_once().windows == 1  # window 0; window 1 waits for rank 3's entry
    clock.t += 61
    assert w.run_once().windows == 1  # window 1 by grace; window 2 holds the newest steps
    # A rank that finished owes nothing more: its last window is compared at once.
    for r in range(4):
        post(client, rank=r, world=4, first=3 * STEPS + 1, times=[], final=True, profiles_through=8)
    assert w.run_once().windows == 1


def test_hang_opens_and_resolves_and_a_finished_run_is_no_hang(client: TestClient, engine: Engine) -> None:
    clock = Clock()
    old = clock.t - 200
    send_windows(client, range(0, 2), wall_end=old)
    w = worker(engine, clock, hang_floor_s=60.0)
    [(_, t)] = w.run_once().transitions
    assert (t.finding.key, t.finding.status, t.previous_status) == ("hang:run", "open", None)
    (ev,) = events(client, kind="hang")
    assert ev["evidence"]["threshold_s"] == 60.0 and ev["evidence"]["silent_s"] == pytest.approx(200, abs=2)
    assert "has made no step for" in ev["message"] and ev["first_step"] == 16
    assert w.run_once().transitions == []  # still hung: refreshed, not re-opened

    # Rank 5 resumes alone: the run steps again, the others are silent ranks.
    send_windows(client, range(2, 3), ranks=range(5, 6), wall_end=clock.t)
    kinds = sorted((t.finding.key, t.finding.status) for _, t in w.run_once().transitions)
    assert ("hang:run", "closed") in kinds and ("hang:rank=0", "open") in kinds
    closed = [e for e in events(client, kind="hang") if e["key"] == "hang:run"]
    assert closed[0]["status"] == "closed" and closed[0]["message"].startswith("Resolved: ")

    # Every rank finishes (final batches): nothing is hung, however long the silence.
    send_windows(client, range(3, 4), final_at=3, wall_end=clock.t)
    w.run_once()
    clock.t += 10_000
    assert w.run_once().transitions == []
    assert not events(client, kind="hang", status="open")


def test_a_rank_silent_while_the_others_finish_is_flagged_alone(client: TestClient, engine: Engine) -> None:
    clock = Clock()
    send_windows(client, range(0, 2), wall_end=clock.t - 500)
    send_windows(
        client, range(2, 4), ranks=range(W - 1), final_at=3, wall_end=clock.t
    )  # rank 7 never finishes
    clock.t += 120
    [(_, t)] = worker(engine, clock, hang_floor_s=60.0).run_once().transitions
    assert (t.finding.key, t.finding.ranks, t.finding.hosts) == ("hang:rank=7", (7,), ("node0",))
    assert t.finding.evidence["silent_s"] == pytest.approx(620, abs=2)


def test_seed_arithmetic_through_the_api(client: TestClient, engine: Engine) -> None:
    """635,782 updates at 12 s with 90% calendar efficiency: 98.11 days; a 76-day plan
    needs 9.30 s per update (DESIGN: the seed run missed its plan by 22 days)."""
    tokens_per_step, updates = 4_194_304, 635_782
    deadline = time.time() + 76 * SECONDS_PER_DAY
    plan = {
        "target_tokens": (9 + updates) * tokens_per_step,
        "deadline": deadline,
        "config_fingerprint": "seed",
    }
    # Nine 12 s updates and one 12 s checkpoint: productive 108 s of 120 s wall, 90%.
    tags: list[str | None] = [None] * 9 + ["checkpoint"]
    tokens = [tokens_per_step] * 9 + [0]
    client_settings = client.app.state.settings  # type: ignore[attr-defined]
    assert client_settings.window_seconds == 4.0
    post(client, run="seed", times=[12.0] * 10, tokens=tokens, tags=tags, plan=plan, final=True)
    worker(engine).run_once()
    ov = client.get("/api/v1/runs/seed").json()
    p = ov["progress"]
    assert ov["plan"]["target_tokens"] == plan["target_tokens"]
    assert ov["plan"]["deadline"] == pytest.approx(deadline, abs=1e-3)
    assert p["calendar_efficiency"] == pytest.approx(0.9, rel=1e-12)
    assert p["tokens_done"] == 9 * tokens_per_step
    assert p["remaining_steps"] == pytest.approx(updates, rel=1e-12)
    assert round(p["eta_s"] / SECONDS_PER_DAY, 2) == 98.11
    assert p["finish_at"] - time.time() == pytest.approx(p["eta_s"], abs=5)
    assert p["finish_early_at"] == p["finish_late_at"] == pytest.approx(p["finish_at"])  # no spread
    assert round(p["required_step_time_s"], 2) == 9.30
    assert p["on_track"] is False and p["step_time_s"] == 12.0


def test_baseline_run_with_the_same_fingerprint(client: TestClient, engine: Engine) -> None:
    base_plan = {"config_fingerprint": "cfg-a"}
    one = {"ranks": range(1), "world": 1}  # regressions need only the job series
    send_windows(client, range(0, 36), run="base", final_at=35, plan=base_plan, **one)
    worker(engine).run_once()
    slower_plan = {**base_plan, "baseline_run": "base"}
    send_windows(client, range(0, 8), run="slower", step_s=0.55, plan=slower_plan, **one)
    other_plan = {"config_fingerprint": "cfg-b", "baseline_run": "base"}
    send_windows(client, range(0, 8), run="other", step_s=0.55, plan=other_plan, **one)
    worker(engine).run_once()
    slower = client.get("/api/v1/runs/slower").json()
    assert slower["analysis"]["baseline"] == "base"
    regressions = {e["key"]: e for e in events(client, "slower", kind="regression")}
    step = regressions["regression:step_time"]
    assert step["status"] == "open" and step["evidence"]["opened_window"] <= 5  # long before 30 own samples
    assert step["evidence"]["change_ratio"] == pytest.approx(0.10, rel=0.01)
    assert "regression:mfu" in regressions
    other = client.get("/api/v1/runs/other").json()
    assert other["analysis"]["baseline"].startswith("own (baseline run base has fingerprint cfg-a")
    assert not events(client, "other", kind="regression")


def test_profile_merges_into_its_window_and_final_may_be_empty(client: TestClient, engine: Engine) -> None:
    # One rank (no member list: the world is its group), so each window's split runs at once.
    first = profile_entry(first_step=1, enter=[0.2, 0.7, 1.2, 1.7], end=[0.3, 0.8, 1.3, 1.8], ranks=None)
    second = profile_entry(first_step=5, enter=[0.2, 0.7], end=[0.4, 0.9], compute=0.2, ranks=None)
    post(client, first=1, times=[0.5] * 4, profiles=[first])
    post(client, first=5, times=[0.5] * 4, profiles=[second])
    post(client, first=9, times=[], final=True)
    with engine.connect() as conn:
        row = conn.execute(select(RankWindow.__table__)).one()
        rank = conn.execute(select(Rank.__table__)).one()
    assert (row.window, row.n_steps, row.profiled_steps, row.skew_steps) == (0, 8, 6, 6)
    assert row.compute_s == pytest.approx((4 * 0.3 + 2 * 0.2) / 6)
    assert row.comm_exposed_s == pytest.approx(0.05) and row.comm_wait_s == pytest.approx(0.0)
    assert row.comm_transfer_s == pytest.approx((4 * 0.1 + 2 * 0.2) / 6)
    assert row.group_transfer_s is None  # a group without members has no communicator type
    assert (rank.last_step, rank.final_step) == (8, 8)
    bad = client.post("/api/v1/ingest", json=payload(first=1, times=[]))
    assert bad.status_code == 422 and "only a final batch" in bad.json()["detail"]


def test_the_v1_breakdown_summary_is_refused_naming_profiles(client: TestClient, engine: Engine) -> None:
    summary = {"steps": 4, "compute_s": 1.0, "comm_exposed_s": 0.2, "idle_s": 0.1, "comm_wait_s": 0.05}
    r = client.post("/api/v1/ingest", json={**payload(first=1, times=[0.5] * 4), "profile": summary})
    assert r.status_code == 422 and "profiles" in r.json()["detail"], r.text
    with engine.connect() as conn:
        assert conn.execute(select(RankWindow.__table__)).all() == []


def test_a_provisional_window_size_holds_the_windows_back_but_not_the_hangs(
    client: TestClient, engine: Engine
) -> None:
    """Every rank's first batch is step 1 alone (a 40 s first step): the run's window size
    is a placeholder of one step, and no window is analysed on it; a silence of 700 s
    (past ten such steps) is still a hang. Once the ranks' next batches show the pace, the
    windows are analysed at the settled size (8 steps)."""
    clock = Clock()
    for r in range(W):
        post(client, rank=r, world=W, times=[40.0], wall_end=clock.t - 700)
    w = worker(engine, clock, hang_floor_s=60.0)
    report = w.run_once()
    assert report.windows == 0
    assert [(t.finding.key, t.finding.status) for _, t in report.transitions] == [("hang:run", "open")]
    for r in range(W):
        post(client, rank=r, world=W, first=2, times=[0.5] * (2 * STEPS), wall_end=clock.t)
    with engine.connect() as conn:
        assert {ws for (ws,) in conn.execute(select(RankWindow.window)).all()} == {0, 1, 2}
    report = w.run_once()
    assert report.windows == 2  # windows 0 and 1 are complete on every rank (steps 1-16)


def test_a_pass_holds_no_snapshot_while_it_computes(
    pg_admin: str, pg_at_head: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL (SQLite keeps no row versions): while the worker turns the rows it read
    into its detectors' types, between one read and the next, and while it turns windows
    into findings (Python; seconds at thousands of ranks), no session of the database
    holds a snapshot or a transaction id (``reads_hold_no_snapshot``), so the versions
    that ingest's in-place updates of ``job_steps`` leave behind can be pruned meanwhile.
    Seen from another session, as the server sees it."""
    held: list[list[tuple[Any, ...]]] = []
    converted: list[list[tuple[Any, ...]]] = []
    feed = RunAnalysis.feed

    def sessions_holding() -> list[tuple[Any, ...]]:
        with eng.connect() as probe:
            rows = probe.exec_driver_sql(
                "SELECT pid, state, query FROM pg_stat_activity WHERE datname = current_database() "
                "AND backend_type = 'client backend' AND pid <> pg_backend_pid() "
                "AND (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL)"
            )
            return [tuple(r) for r in rows]

    def observed(self: RunAnalysis, *args: Any, **kwargs: Any) -> list[Change]:
        held.append(sessions_holding())
        return feed(self, *args, **kwargs)

    def rank_window(**fields: Any) -> RankWindowIn:  # as a chunk of rows is converted
        converted.append(sessions_holding())
        return RankWindowIn(**fields)

    with pg.fresh_database(pg_admin, template=pg_at_head) as url:
        eng = make_engine(url)
        try:
            settings = Settings(database_url=url, window_seconds=4.0, analysis_enabled=False)
            with TestClient(create_app(settings, engine=eng)) as c:
                send_windows(c, range(0, 5), slow_rank=3)
            monkeypatch.setattr(RunAnalysis, "feed", observed)
            monkeypatch.setattr(inputs, "RankWindow", rank_window)
            monkeypatch.setattr(inputs, "RANK_CHUNK", 2)  # several reads per window
            # One window per transaction, four on the worker's one connection: past the
            # five runs after which psycopg prepares a statement (``reads_hold_no_snapshot``).
            one = make_engine(url, pool_size=1, max_overflow=0)
            try:
                assert worker(one, max_windows=1).run_once().windows == 4
            finally:
                one.dispose()
        finally:
            eng.dispose()
    assert len(held) == 4 and held == [[]] * 4, held
    assert len(converted) >= 4 * 2 and all(c == [] for c in converted), converted


def test_a_chunk_of_ranks_reads_and_drops_those_ranks_whether_or_not_they_are_contiguous(
    client: TestClient, engine: Engine
) -> None:
    """The worker's reads and deletes by chunk of ranks (``inputs.window_ranks``: a
    contiguous chunk as a range on PostgreSQL; ``inputs.staged_ranks``: one array there):
    a chunk with a gap must neither read nor delete the rank in the gap, and a contiguous
    one must read every rank in it."""
    send_windows(client, range(0, 2), ranks=range(5), world=5)
    timings = StepTiming.__table__
    with engine.begin() as conn:
        run = run_info(conn.execute(select(Run.__table__)).one())
        rows = inputs.rank_rows(conn, run.id)
        for chosen in ([1, 2, 3], [0, 1, 3, 4], [4], [0, 2, 4]):
            got = inputs.rank_windows(conn, run, [r for r in rows if r.rank in chosen], 0, 1)
            assert sorted(got) == [0, 1]
            assert all(sorted(w.rank for w in ws) == chosen for ws in got.values()), (chosen, got)
        conn.execute(
            timings.insert(),
            [staged_row(run.id, r, 1, [(0.5, 0.0, None, None, None)] * 2) for r in range(5)],
        )
        gap = [r for r in rows if r.rank in (0, 1, 3, 4)]
        assert sorted(s.rank for s in inputs.step_timings(conn, run, gap, 0, 0)[0]) == [0, 1, 3, 4]
        assert outputs.drop_step_timings(conn, run.id, [4, 0, 1, 3, 1], through_step=2) == 4
        assert conn.execute(select(timings.c.rank).distinct()).scalars().all() == [2]


def test_staged_timing_reads_back_per_window_and_rank_with_its_gaps_and_without_tagged_steps(
    client: TestClient, engine: Engine
) -> None:
    """``inputs.step_timings`` (rows of a rank's consecutive steps, packed) against the
    rule written out step by step: per window, one entry per rank
    in rank order, its steps from the first it reported to the last, the ones it did not
    report unmeasured (0 s, None), the tagged steps left out, a rank not asked for absent."""
    send_windows(client, range(0, 2), ranks=range(5), world=5)  # steps 1-16, windows 0 and 1
    rng = random.Random(7)
    staged = {
        (r, s): (rng.random(), rng.random(), *(rng.choice([None, rng.random()]) for _ in range(3)))
        for r in range(5)
        for s in range(1, 2 * STEPS + 1)
        if rng.random() < 0.75 or r == 0
    }
    tagged = {3, 12}
    with engine.begin() as conn:
        run = run_info(conn.execute(select(Run.__table__)).one())
        conn.execute(
            JobStep.__table__.update()
            .where(JobStep.__table__.c.step.in_(tagged), JobStep.__table__.c.run_id == run.id)
            .values(tag=1)
        )
        # As batches would stage them: each rank's consecutive steps in rows of 1-5 steps.
        rows: list[dict[str, Any]] = []
        for r in range(5):
            steps = sorted(s for rank, s in staged if rank == r)
            while steps:
                n, most = 1, min(len(steps), rng.randint(1, 5))
                while n < most and steps[n] == steps[0] + n:
                    n += 1
                rows.append(staged_row(run.id, r, steps[0], [staged[r, s] for s in steps[:n]]))
                steps = steps[n:]
        conn.execute(StepTiming.__table__.insert(), rows)
        asked = [r for r in inputs.rank_rows(conn, run.id) if r.rank != 2]
        got = inputs.step_timings(conn, run, asked, 0, 1)
    expected: dict[int, list[RankSteps]] = {}
    for w in (0, 1):
        for r in asked:
            steps = [
                s
                for s in range(w * STEPS + 1, (w + 1) * STEPS + 1)
                if (r.rank, s) in staged and s not in tagged
            ]
            if not steps:
                continue
            n = steps[-1] - steps[0] + 1
            cols: list[list[Any]] = [[0.0] * n, [0.0] * n, [None] * n, [None] * n, [None] * n]
            for s in steps:
                for col, v in zip(cols, staged[r.rank, s], strict=True):
                    col[s - steps[0]] = v
            expected.setdefault(w, []).append(RankSteps(r.rank, r.host, steps[0], *cols))
    assert {w: [plain(rs) for rs in ws] for w, ws in got.items()} == {
        w: [plain(rs) for rs in ws] for w, ws in expected.items()
    }
    assert any(len(e.step_time_s) > 1 and 0.0 in e.step_time_s for es in got.values() for e in es)  # gaps


def plain(rs: RankSteps) -> tuple[Any, ...]:
    """A :class:`RankSteps` with its values as lists, None where not measured (the worker
    reads float64 arrays, NaN where not measured)."""
    return (
        rs.rank,
        rs.host,
        rs.first_step,
        *(
            [None if v is None or v != v else float(v) for v in values]
            for values in dataclasses.astuple(rs)[3:]
        ),
    )


def staged_row(
    run_id: int, rank: int, first: int, steps: list[tuple[Any, ...]], sent_at: float = 0.0
) -> dict[str, Any]:
    """A ``step_timings`` row holding ``steps`` (each its five values, None: unknown) from
    step ``first``, packed as ingest packs a batch's."""
    cols = list(zip(*steps, strict=True))
    return {
        "run_id": run_id,
        "rank": rank,
        "first_step": first,
        "last_step": first + len(steps) - 1,
        "sent_at": sent_at,
        **{k: packed.pack(np.array(c, dtype=float)) for k, c in zip(STEP_TIMING_VALUES, cols, strict=True)},
    }


def test_a_step_two_batches_carry_is_the_later_sents_and_a_batch_is_dropped_with_its_last_step(
    client: TestClient, engine: Engine
) -> None:
    """An agent restarted from a checkpoint sends steps again under new batch ids, from
    another step than before: the reader gives each step carried twice to the batch sent
    later, whichever starts later. A batch that reaches into the next window is read for
    both windows' steps and dropped only once the window of its last step is analysed."""
    send_windows(client, range(0, 1), ranks=range(2), world=2)  # the run (8-step windows)
    with engine.begin() as conn:
        run = run_info(conn.execute(select(Run.__table__)).one())
        assert run.window_steps == STEPS == 8
        ranks = inputs.rank_rows(conn, run.id)
        conn.execute(StepTiming.__table__.delete())

        def values(tag: float, steps: range) -> list[tuple[Any, ...]]:
            return [(tag + s / 100, 0.0, tag if s % 2 else None, None, tag) for s in steps]

        conn.execute(
            StepTiming.__table__.insert(),
            [
                staged_row(run.id, 0, 1, values(1.0, range(1, 7)), sent_at=10.0),  # steps 1-6
                staged_row(run.id, 0, 7, values(1.0, range(7, 13)), sent_at=20.0),  # 7-12: windows 0 and 1
                staged_row(run.id, 0, 4, values(2.0, range(4, 10)), sent_at=30.0),  # resent 4-9, after both
                staged_row(run.id, 1, 3, values(3.0, range(3, 11)), sent_at=5.0),  # 3-10
                staged_row(run.id, 1, 9, values(4.0, range(9, 12)), sent_at=1.0),  # 9-11, sent before 3-10
            ],
        )
        got = inputs.step_timings(conn, run, ranks, 0, 1)
        later = {0: {s: 2.0 if 4 <= s <= 9 else 1.0 for s in range(1, 13)}}
        later[1] = {s: 4.0 if s == 11 else 3.0 for s in range(3, 12)}
        for w, window in got.items():
            for rs in window:
                steps = range(rs.first_step, rs.first_step + len(rs.step_time_s))
                tags = [later[rs.rank][s] for s in steps]
                _, _, _, step_time, _, sync, cpu, runq = plain(rs)
                assert step_time == [t + s / 100 for t, s in zip(tags, steps, strict=True)], (w, rs)
                assert sync == [t if s % 2 else None for t, s in zip(tags, steps, strict=True)]
                assert cpu == [None] * len(steps) and runq == tags
        assert {w: [(rs.rank, rs.first_step, len(rs.step_time_s)) for rs in ws] for w, ws in got.items()} == {
            0: [(0, 1, 8), (1, 3, 6)],
            1: [(0, 9, 4), (1, 9, 3)],
        }
        # Window 0 analysed: the batches ending in it go, those reaching into window 1 stay.
        assert outputs.drop_step_timings(conn, run.id, [0, 1], through_step=8) == 1
        left = conn.execute(select(StepTiming.__table__.c.rank, StepTiming.__table__.c.first_step)).all()
        assert sorted(left) == [(0, 4), (0, 7), (1, 3), (1, 9)]
        assert [len(rs.step_time_s) for rs in inputs.step_timings(conn, run, ranks, 1, 1)[1]] == [4, 3]


def test_the_rank_read_of_each_pass_matches_the_stored_rows_and_follows_their_changes(
    client: TestClient, engine: Engine
) -> None:
    """``inputs.rank_rows`` reads the coordinates as text, parsed once per distinct text:
    it must give what the column's own JSON type reads, and a rank moved by a restart
    (new coordinates, or none) must not keep its old ones."""
    send_windows(client, range(1), ranks=range(3), world=3)
    table = Rank.__table__

    def check() -> list[inputs.RankRow]:
        with engine.connect() as conn:
            run_id = conn.execute(select(table.c.run_id)).scalars().first()
            assert run_id is not None
            rows = inputs.rank_rows(conn, run_id)
            stored = conn.execute(select(table).order_by(table.c.rank)).all()
        assert [r.rank for r in rows] == [s.rank for s in stored] == [0, 1, 2]
        for row, s in zip(rows, stored, strict=True):
            assert dict(row.coords) == (s.coords or {})
            assert (row.host, row.local_rank, row.last_step, row.final_step) == (
                s.host,
                s.local_rank,
                s.last_step,
                s.final_step,
            )
            assert row.progress.last_step == s.last_step and row.progress.rank == s.rank
        return rows

    before = check()
    assert before[1].coords.get("dp") == 1
    with engine.begin() as conn:
        conn.execute(table.update().where(table.c.rank == 1).values(coords={"dp": 0, "tp": 1}))
        conn.execute(table.update().where(table.c.rank == 2).values(coords=None))
    after = check()
    assert dict(after[1].coords) == {"dp": 0, "tp": 1} and dict(after[2].coords) == {}


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The run ids ``inputs.rank_rows`` is called with, in order (the real read, counted)."""
    calls: list[int] = []
    read = inputs.rank_rows

    def counted(conn: Connection, run_id: int) -> list[inputs.RankRow]:
        calls.append(run_id)
        return read(conn, run_id)

    monkeypatch.setattr(inputs, "rank_rows", counted)
    return calls


def test_a_pass_reads_the_ranks_again_only_when_a_rank_row_changed(
    client: TestClient, engine: Engine, reads: list[int]
) -> None:
    """Every pass needs every rank of every active run; the rows are read again only when
    the run's rank fingerprint moved, and a change of ``last_seen`` alone (all a
    heartbeat changes) moves it."""
    clock = Clock()
    send_windows(client, range(0, 2), wall_end=clock.t - 200)
    w = worker(engine, clock, hang_floor_s=60.0)
    [(_, t)] = w.run_once().transitions
    assert (t.finding.key, t.finding.status) == ("hang:run", "open") and len(reads) == 1
    assert w.run_once().transitions == [] and len(reads) == 1  # nothing changed: not read

    with engine.begin() as conn:  # every rank seen now, no step made: only last_seen moves
        conn.execute(Rank.__table__.update().values(last_seen=datetime.fromtimestamp(clock.t, timezone.utc)))
    kinds = [(t.finding.key, t.finding.status) for _, t in w.run_once().transitions]
    assert kinds == [("hang:run", "closed")] and len(reads) == 2


def test_the_kept_rank_rows_are_bounded_and_the_least_recently_read_run_goes_first(
    client: TestClient, engine: Engine, reads: list[int]
) -> None:
    """Two runs of W ranks each: held together when the bound has room for 2W rows; with
    one row less, reading one run drops the other, read again when next needed."""
    send_windows(client, range(1), run="run-a")
    send_windows(client, range(1), run="run-b")
    with engine.connect() as conn:
        a, b = (conn.execute(select(Run.id).where(Run.name == n)).scalar_one() for n in ("run-a", "run-b"))
        roomy, tight = inputs.RankReads(max_rows=2 * W), inputs.RankReads(max_rows=2 * W - 1)
        for kept in (roomy, tight):
            assert len(kept.rows(conn, a)) == len(kept.rows(conn, b)) == W
        assert reads == [a, b, a, b]
        roomy.rows(conn, a)  # both kept: no read
        roomy.rows(conn, b)  # still both, however often they are read
        roomy.rows(conn, a)
        tight.rows(conn, b)  # b is kept (the newest)
        assert reads == [a, b, a, b]
        tight.rows(conn, a)  # a was dropped to keep b
        assert reads == [a, b, a, b, a]
