"""The always-on collective timing through the collector: ingest stages it per (run,
rank, batch), its steps packed, the worker turns it into late-arrival straggler flags and deletes what it
analysed. Real database (SQLite and PostgreSQL), batches through the real API in process,
worker passes run by the test."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, event, func, select

from stepwatch_server.app import create_app
from stepwatch_server.settings import Settings
from stepwatch_server.storage import packed
from stepwatch_server.storage.backend import open_storage
from stepwatch_server.storage.columns import STEP_TIMING_VALUES
from stepwatch_server.storage.models import LinkSample, StepTiming
from stepwatch_server.worker import AnalysisWorker, WorkerConfig

from ..payloads import payload

W = 4  # ranks
STEPS = 8  # steps per window (window_seconds 4 / 0.5 s steps)


@pytest.fixture
def client(db_url: str, engine: Engine) -> Iterator[TestClient]:
    app = create_app(Settings(database_url=db_url, window_seconds=4.0, analysis_enabled=False), engine=engine)
    with TestClient(app) as c:
        yield c


def comm(
    rank: int,
    window: int,
    *,
    late_rank: int | None,
    extra_cpu: float,
    clock: str = "host",
    extra_runq: float | None = None,
) -> dict[str, Any]:
    """Per step: ``late_rank`` arrives 0.05 s after its peers (so its sync is the short
    one: nobody is left to wait for) and burns ``extra_cpu`` more CPU; small jitter. With
    ``extra_runq``, every rank's window carries its run-queue wait (5 ms per step), the
    late rank's ``extra_runq`` seconds per step more."""
    sync: list[float | None] = []
    cpu: list[float | None] = []
    for j in range(STEPS):
        jitter = 0.0005 * ((rank * 3 + j + window) % 4)
        late = rank == late_rank
        sync.append(0.01 + jitter if late else 0.06 + jitter)
        cpu.append(0.3 + jitter + (extra_cpu if late else 0.0))
    sync[3] = None if rank == 0 and window == 0 else sync[3]  # a step without a collective
    arrive = [0.4] * STEPS
    end: list[float | None] = [0.45] * STEPS
    out = {"version": 1, "clock": clock, "arrive_s": arrive, "end_s": end, "sync_s": sync, "cpu_s": cpu}
    if extra_runq is not None:
        out["runq_s"] = STEPS * (0.005 + 0.0002 * rank + (extra_runq if rank == late_rank else 0.0))
    return out


def send(
    client: TestClient,
    windows: range,
    *,
    late_rank: int | None,
    extra_cpu: float = 0.05,
    clocks: tuple[str, ...] = ("host",) * W,
    tag: str | None = None,
    extra_runq: float | None = None,
) -> None:
    for w in windows:
        for r in range(W):
            body = payload(
                rank=r,
                world=W,
                first=w * STEPS + 1,
                times=[0.5] * STEPS,
                waits=[0.001] * STEPS,
                tags=[tag] * STEPS if tag else None,
                comm=comm(
                    r, w, late_rank=late_rank, extra_cpu=extra_cpu, clock=clocks[r], extra_runq=extra_runq
                ),
            )
            for _ in range(2 if w == 0 else 1):  # the first window's batches are retried
                assert client.post("/api/v1/ingest", json=body).status_code == 200


def worker(engine: Engine) -> AnalysisWorker:
    return AnalysisWorker(open_storage(engine), WorkerConfig(), clock=time.time)


class Staged(NamedTuple):
    """One staged step, unpacked from its batch's row."""

    rank: int
    step: int
    step_time_s: float
    data_wait_s: float
    sync_s: float | None
    cpu_s: float | None
    runq_s: float | None


def staged(engine: Engine) -> list[Staged]:
    """Every staged step, from the rows (one per rank and batch, ``packed.py``) as stored."""
    st = StepTiming.__table__
    with engine.connect() as conn:
        rows = conn.execute(select(st).order_by(st.c.rank, st.c.first_step)).all()
    out = []
    for r in rows:
        cols = [packed.unpack(getattr(r, k)) for k in STEP_TIMING_VALUES]
        assert all(len(c) == r.last_step - r.first_step + 1 for c in cols), r
        for j in range(len(cols[0])):
            v = [float(c[j]) for c in cols]
            out.append(
                Staged(r.rank, r.first_step + j, v[0], v[1], *(None if math.isnan(x) else x for x in v[2:]))
            )
    return out


def test_ingest_stages_each_rank_step_once_with_its_values(client: TestClient, engine: Engine) -> None:
    send(client, range(0, 2), late_rank=2)
    rows = staged(engine)
    assert len(rows) == W * 2 * STEPS  # retried batches stored once
    by_key = {(r.rank, r.step): r for r in rows}
    r2 = by_key[(2, 1)]
    assert (r2.step_time_s, r2.data_wait_s) == (0.5, 0.001)
    assert r2.sync_s == pytest.approx(0.01 + 0.0005 * (6 % 4))
    assert r2.cpu_s == pytest.approx(0.35 + 0.0005 * (6 % 4))
    assert by_key[(0, 4)].sync_s is None and by_key[(0, 4)].cpu_s is not None


def test_a_late_rank_with_extra_cpu_is_a_compute_straggler_and_staging_is_emptied(
    client: TestClient, engine: Engine
) -> None:
    send(client, range(0, 4), late_rank=2)
    report = worker(engine).run_once()
    assert report.windows == 3  # window 3 holds the newest steps: not complete yet
    [(_, opened)] = report.transitions
    f = opened.finding
    assert (f.key, f.cause, f.ranks, f.status) == ("straggler:compute:rank=2", "compute", (2,), "open")
    # Only the window not yet analysed is still staged.
    assert {r.step for r in staged(engine)} == set(range(3 * STEPS + 1, 4 * STEPS + 1))
    (ev,) = client.get("/api/v1/runs/test-run/events").json()
    # Window 0 lines up 7 steps (rank 0's step 4 had no collective), fewer than one test
    # needs (8): it is judged with window 1, and the second test is window 2's.
    assert ev["evidence"]["opened_window"] == 2
    assert ev["cost_seconds"] == pytest.approx(0.05, abs=0.002)
    assert ev["cost_ratio"] == pytest.approx(0.1, abs=0.005)
    assert ev["evidence"]["extra_cpu_s"] == pytest.approx(0.05, abs=0.002)
    assert ev["message"].startswith("Rank 2 (host node0) is a compute straggler since step 1")


#: The start of the worker's read of a window's rows from each table (its aggregates over
#: the same tables are a row each and stay in text).
WINDOW_READS = {
    "step_timings": "SELECT step_timings.rank, step_timings.first_step,",
    "rank_windows": "SELECT rank_windows.run_id, rank_windows.rank, rank_windows.window,",
    "link_samples": "SELECT link_samples.rank, link_samples.step,",
}


@pytest.mark.parametrize("table", sorted(WINDOW_READS))
def test_the_worker_reads_each_windows_rows_in_binary_on_postgresql(
    client: TestClient, engine: Engine, table: str
) -> None:
    """In text, PostgreSQL sends each byte of a packed column as two hex digits and each
    number as its digits, which psycopg decodes: about 3x the reader's CPU per row of
    packed steps, 2x per rank window (``storage/engine.py``). The worker's reads of a
    window's rows ask for binary rows; the analysis is the same."""
    send(client, range(0, 4), late_rank=2)
    formats: list[int] = []

    def seen(_c: Any, cursor: Any, statement: str, *_: Any) -> None:
        if " ".join(statement.replace('"', "").split()).startswith(WINDOW_READS[table]):
            formats.append(int(cursor.pgresult.fformat(0)) if hasattr(cursor, "pgresult") else -1)

    event.listen(engine, "after_cursor_execute", seen)
    try:
        report = worker(engine).run_once()
    finally:
        event.remove(engine, "after_cursor_execute", seen)
    [(_, opened)] = report.transitions
    assert opened.finding.key == "straggler:compute:rank=2"
    assert formats, f"the worker read no {table}"
    assert set(formats) == ({1} if engine.dialect.name == "postgresql" else {-1}), formats


def test_device_clocked_sections_are_staged_and_judged_as_host_ones(
    client: TestClient, engine: Engine
) -> None:
    """The agent's CUDA path labels its sections ``"clock": "device"`` (offsets from CUDA
    events): the collector stages the same values and computes wait and transfer the same
    way, whichever clock each rank used (here two ranks on each)."""
    send(client, range(0, 4), late_rank=2, clocks=("device", "host", "device", "host"))
    rows = staged(engine)
    assert len(rows) == W * 4 * STEPS
    assert {(r.rank, r.step): r.sync_s for r in rows}[(2, 1)] == pytest.approx(0.01 + 0.0005 * (6 % 4))
    [(_, opened)] = worker(engine).run_once().transitions
    f = opened.finding
    assert (f.key, f.cause, f.ranks) == ("straggler:compute:rank=2", "compute", (2,))
    (ev,) = client.get("/api/v1/runs/test-run/events").json()
    assert ev["cost_seconds"] == pytest.approx(0.05, abs=0.002), "the same numbers as on the host clock"


def test_a_comm_clock_outside_the_wire_contract_is_refused(client: TestClient) -> None:
    body = payload(rank=0, world=W, first=1, times=[0.5] * STEPS, waits=[0.001] * STEPS)
    body["comm"] = comm(0, 1, late_rank=None, extra_cpu=0.0, clock="cuda_events")
    resp = client.post("/api/v1/ingest", json=body)
    assert resp.status_code == 422 and "clock" in resp.text


def test_a_late_rank_without_extra_cpu_is_a_host_stall(client: TestClient, engine: Engine) -> None:
    send(client, range(0, 4), late_rank=1, extra_cpu=0.0)
    [(_, opened)] = worker(engine).run_once().transitions
    assert (opened.finding.key, opened.finding.cause) == ("straggler:host_stall:rank=1", "host_stall")
    (ev,) = client.get("/api/v1/runs/test-run/events").json()
    assert ev["cause"] == "host_stall"


def test_a_rank_held_in_the_buffer_broadcast_by_a_late_peer_is_not_the_straggler(
    client: TestClient, engine: Engine
) -> None:
    """Recorded on real gloo ranks (a slow loader on rank 3): gloo relays DDP's buffer
    broadcast along a tree in which rank 1 receives through rank 3, so rank 1 starts its
    forward as late as rank 3 and both reach the all-reduce last, rank 1 with no more work
    and no loader wait (it was named a host stall in every such run). Its wait in the
    broadcast (``comm.broadcast_s``) is a wait for a peer like the all-reduce's: staged
    into its sync, it leaves rank 1 with its peers and rank 3 the one they waited for."""
    for w in range(4):
        for r in range(W):
            c = comm(r, w, late_rank=None, extra_cpu=0.0)
            late = r in (1, 3)  # both reach the all-reduce 0.05 s late: short syncs
            c["sync_s"] = [None if v is None else (v - 0.05 if late else v) for v in c["sync_s"]]
            c["broadcast_s"] = [0.05 if r == 1 else 0.0002] * STEPS  # rank 1 waited for rank 3 there
            waits = [0.051 if r == 3 else 0.001] * STEPS  # rank 3's loader
            body = payload(rank=r, world=W, first=w * STEPS + 1, times=[0.5] * STEPS, waits=waits, comm=c)
            assert client.post("/api/v1/ingest", json=body).status_code == 200
    by_key = {(r.rank, r.step): r for r in staged(engine)}
    # Step 2 (window 0, j = 1): jitter 0.0005 * ((3 * rank + 1) % 4).
    assert by_key[(1, 2)].sync_s == pytest.approx(0.06 + 0.0 - 0.05 + 0.05)
    assert by_key[(3, 2)].sync_s == pytest.approx(0.06 + 0.001 - 0.05 + 0.0002)
    opened = [t[1].finding.key for t in worker(engine).run_once().transitions]
    assert opened == ["straggler:data:rank=3"], opened


def test_the_agents_microseconds_are_staged_as_the_same_seconds(client: TestClient, engine: Engine) -> None:
    """The agent sends version 2 of the section (integer microseconds, about half the
    bytes of version 1's seconds); ingest stages the same seconds from either."""
    v1 = comm(1, 0, late_rank=None, extra_cpu=0.0) | {"broadcast_s": [0.0002] * STEPS}

    def us(values: list[float | None]) -> list[int | None]:
        return [None if v is None else round(v * 1e6) for v in values]

    v2 = {
        "version": 2,
        "clock": "host",
        "arrive_us": us(v1["arrive_s"]),
        "sync_us": us(v1["sync_s"]),
        "cpu_us": us(v1["cpu_s"]),
        "broadcast_us": us(v1["broadcast_s"]),
    }
    for r, c in ((0, v1), (1, v2)):
        body = payload(rank=r, world=W, first=1, times=[0.5] * STEPS, waits=[0.001] * STEPS, comm=c)
        assert client.post("/api/v1/ingest", json=body).status_code == 200
    rows = {r: sorted((t.step, t.sync_s, t.cpu_s) for t in staged(engine) if t.rank == r) for r in (0, 1)}
    assert len(rows[1]) == STEPS
    for a, b in zip(rows[0], rows[1], strict=True):
        assert a == pytest.approx(b)


def test_a_broadcast_wait_per_step_must_match_the_steps(client: TestClient) -> None:
    body = payload(rank=0, world=W, first=1, times=[0.5] * STEPS, waits=[0.001] * STEPS)
    body["comm"] = comm(0, 1, late_rank=None, extra_cpu=0.0) | {"broadcast_s": [0.01] * (STEPS - 1)}
    resp = client.post("/api/v1/ingest", json=body)
    assert resp.status_code == 422 and "comm.broadcast_s has 7 values but steps.time_s has 8" in resp.text


def test_a_late_rank_that_waited_for_a_core_is_cpu_contention_and_needs_four_windows(
    client: TestClient, engine: Engine
) -> None:
    """The host-stall test's rank, but its window says it waited on the run queue 45 ms
    per step more than its peers (runnable, no core free) for its 50 ms of lateness: not a
    stall. Such a rank opens a ``cpu_contention`` flag after four late windows, not two
    (on a busy host the scheduler leaves some rank waiting for a few seconds by chance)."""
    send(client, range(0, 4), late_rank=1, extra_cpu=0.0, extra_runq=0.045)
    rows = {(r.rank, r.step): r for r in staged(engine)}
    assert rows[(1, 9)].runq_s == pytest.approx(0.005 + 0.0002 + 0.045), "shared by step time"
    assert rows[(0, 9)].runq_s == pytest.approx(0.005)
    w = worker(engine)
    assert w.run_once().transitions == [], "windows 0+1 and 2 judged: two verdicts, a stall's persistence"
    send(client, range(4, 6), late_rank=1, extra_cpu=0.0, extra_runq=0.045)
    [(_, opened)] = w.run_once().transitions
    f = opened.finding
    assert (f.key, f.cause, f.ranks) == ("straggler:cpu_contention:rank=1", "cpu_contention", (1,))
    (ev,) = client.get("/api/v1/runs/test-run/events").json()
    assert ev["cause"] == "cpu_contention" and ev["evidence"]["opened_window"] == 4
    assert ev["evidence"]["extra_runq_s"] == pytest.approx(0.045, abs=0.001)
    assert "waits for CPU cores since step" in ev["message"] and "run-queue wait" in ev["message"]


def test_run_queue_wait_that_does_not_explain_the_lateness_leaves_a_host_stall(
    client: TestClient, engine: Engine
) -> None:
    """10 ms more run-queue wait per step explains a fifth of 50 ms of lateness: the
    rest stalled (asleep, not runnable), a host stall as without the measurement."""
    send(client, range(0, 4), late_rank=1, extra_cpu=0.0, extra_runq=0.010)
    [(_, opened)] = worker(engine).run_once().transitions
    assert (opened.finding.key, opened.finding.cause) == ("straggler:host_stall:rank=1", "host_stall")


@pytest.mark.parametrize("tag", ["warmup", "checkpoint"])
def test_a_rank_late_only_in_tagged_steps_raises_nothing(
    client: TestClient, engine: Engine, tag: str
) -> None:
    """The same late rank as in the host-stall test above, but in steps the agent tagged
    (the warm-up, a checkpoint one rank saves): not the run's pace, nothing to flag; the
    untagged windows after them are judged as usual."""
    send(client, range(0, 4), late_rank=1, extra_cpu=0.0, tag=tag)
    send(client, range(4, 6), late_rank=None)
    report = worker(engine).run_once()
    assert report.windows == 5 and report.transitions == []


def test_ranks_arriving_together_raise_nothing(client: TestClient, engine: Engine) -> None:
    send(client, range(0, 6), late_rank=None)
    report = worker(engine).run_once()
    assert report.windows == 5 and report.transitions == []
    assert client.get("/api/v1/runs/test-run/events").json() == []
    assert len(staged(engine)) == W * STEPS
    with engine.connect() as conn:  # one row per rank and batch: the newest window's
        assert conn.execute(select(func.count()).select_from(StepTiming)).scalar() == W


# -- links: the agent's per-connection timing ----------------------------------------
MB = 1_000_000


def ring_links(rank: int, *, slow_rank: int | None) -> list[dict[str, Any]]:
    """This rank's two ring connections of one window (gloo's ring: r sends to r-1),
    8 steps of 2.5 MB each way; the connections of ``slow_rank`` at 15 MB/s, others 100."""

    def ep(a: int, b: int) -> int:
        return 1000 + a * 10 + b

    out = []
    dst, src = (rank - 1) % W, (rank + 1) % W
    rate = 15 * MB if slow_rank in (rank, dst) else 100 * MB
    out.append(
        {
            "local": ep(rank, dst),
            "peer": ep(dst, rank),
            "bytes": 20 * MB,
            "received": 40_000,
            "busy_s": 20 * MB / rate,
        }
    )
    out.append(
        {"local": ep(rank, src), "peer": ep(src, rank), "bytes": 40_000, "received": 20 * MB, "busy_s": 0.01}
    )
    return out


def send_links(client: TestClient, windows: range, *, slow_rank: int | None) -> None:
    for w in windows:
        for r in range(W):
            c = comm(r, w, late_rank=None, extra_cpu=0.0)
            c["links"] = ring_links(r, slow_rank=slow_rank)
            body = payload(
                rank=r, world=W, first=w * STEPS + 1, times=[0.5] * STEPS, waits=[0.001] * STEPS, comm=c
            )
            for _ in range(2 if w == 0 else 1):
                assert client.post("/api/v1/ingest", json=body).status_code == 200


def staged_links(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(LinkSample).order_by(LinkSample.rank, LinkSample.step)).all())


def test_links_are_staged_once_per_batch_and_connection(client: TestClient, engine: Engine) -> None:
    send_links(client, range(0, 2), slow_rank=1)
    rows = staged_links(engine)
    assert len(rows) == W * 2 * 2  # two connections per rank and batch; retries stored once
    r = next(x for x in rows if x.rank == 1 and x.step == STEPS and x.bytes_sent == 20 * MB)
    assert r.busy_s == pytest.approx(20 / 15) and r.steps == STEPS and r.peer_ep == 1000 + 0 * 10 + 1


def test_a_rank_whose_every_connection_is_slow_is_a_link_straggler(
    client: TestClient, engine: Engine
) -> None:
    send_links(client, range(0, 4), slow_rank=1)
    [(_, opened)] = worker(engine).run_once().transitions
    f = opened.finding
    assert (f.key, f.cause, f.ranks) == ("straggler:link:rank=1", "link", (1,))
    (ev,) = client.get("/api/v1/runs/test-run/events").json()
    assert ev["evidence"]["rate_mb_s"] == pytest.approx(15) and ev["evidence"][
        "peer_rate_mb_s"
    ] == pytest.approx(100)
    # 20 MB at 15 instead of 100 MB/s over 8 steps.
    assert ev["cost_seconds"] == pytest.approx((20 / 15 - 0.2) / STEPS, rel=0.01)
    assert {r.step for r in staged_links(engine)} == {4 * STEPS}  # analysed windows dropped


def test_links_at_one_speed_raise_nothing(client: TestClient, engine: Engine) -> None:
    send_links(client, range(0, 5), slow_rank=None)
    assert worker(engine).run_once().transitions == []
