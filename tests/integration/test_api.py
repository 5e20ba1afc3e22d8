"""The collector's API over a real database (SQLite and PostgreSQL), in process."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, func, select

from stepwatch._comm_timing import CommTiming
from stepwatch.flops import Convention
from stepwatch_server.app import create_app
from stepwatch_server.reads import queries
from stepwatch_server.settings import Settings
from stepwatch_server.storage.models import Event, IngestedBatch, JobStep, Rank, RankWindow, Run, unix

from ..payloads import CONVENTION, comm_section, payload

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.fixture
def client(db_url: str, engine: Engine) -> Iterator[TestClient]:
    app = create_app(
        Settings(database_url=db_url, window_seconds=2.0, max_body_bytes=64 * 1024), engine=engine
    )
    with TestClient(app) as c:
        yield c


def _count(engine: Engine, table: type) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(table)).scalar_one())


def test_ingest_then_read_back(client: TestClient) -> None:
    for rank in range(4):
        r = client.post(
            "/api/v1/ingest", json=payload(rank=rank, world=4, times=[0.5] * 8, tokens=[1000] * 8)
        )
        assert r.status_code == 200, r.text
        assert r.json()["stored"] is True
    runs = client.get("/api/v1/runs").json()
    assert [(x["name"], x["world_size"], x["ranks_reporting"], x["last_step"]) for x in runs] == [
        ("test-run", 4, 4, 8)
    ]
    ov = client.get("/api/v1/runs/test-run").json()
    assert ov["steps_stored"] == 8
    assert ov["tokens_total"] == 4 * 8 * 1000
    assert ov["step_time_s"]["mean"] == pytest.approx(0.5)
    assert ov["tokens_per_s"]["mean"] == pytest.approx(4000 / 0.5)
    # The MFU the collector serves is the agent's definition (and the arithmetic is right).
    served = ov["mfu"]["mean"]
    assert served == pytest.approx(Convention.from_dict(CONVENTION).mfu(8000, 4))
    assert served == pytest.approx(8000 * 1e9 / (4 * 1e14))
    assert ov["convention"]["id"] == CONVENTION["id"]
    ranks = client.get("/api/v1/runs/test-run/ranks").json()
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert all(
        r["step_time_s"] == pytest.approx(0.5) and r["tokens_per_s"] == pytest.approx(2000) for r in ranks
    )


def test_retried_batch_is_stored_once(client: TestClient, engine: Engine) -> None:
    p = payload(times=[0.2] * 5)
    first = client.post("/api/v1/ingest", json=p)
    again = client.post("/api/v1/ingest", json=p)
    assert (first.status_code, again.status_code) == (200, 200)
    assert (first.json()["stored"], again.json()["stored"]) == (True, False)
    assert _count(engine, IngestedBatch) == 1
    assert _count(engine, JobStep) == 5
    with engine.connect() as conn:
        assert conn.execute(select(func.sum(JobStep.ranks))).scalar_one() == 5


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda p: p["steps"]["tokens"].__setitem__(2, -5), "steps.tokens.2"),
        (lambda p: p["steps"]["data_wait_s"].pop(), "steps.data_wait_s"),
        (lambda p: p.__setitem__("run", "bad name!"), "run"),
        (lambda p: p["rank"].__setitem__("rank", 9), "rank"),
        (lambda p: p.__setitem__("schema_version", 99), "schema_version"),
        (lambda p: p["steps"].__setitem__("time_s", []), "steps.time_s"),
        (lambda p: p.pop("batch_id"), "batch_id"),
        (lambda p: p.__setitem__("comm", {**comm_section(4), "sync_us": [100]}), "comm.sync_us"),
        (lambda p: p.__setitem__("comm", {**comm_section(4), "sync_s": [0.1] * 4}), "has no sync_s"),
        (
            lambda p: p.__setitem__(
                "comm",
                {
                    "version": 1,
                    **dict.fromkeys(("arrive_s", "end_s", "sync_s", "cpu_s"), [0.1] * 4),
                    "arrive_us": [1] * 4,
                },
            ),
            "comm version 1 has no arrive_us (version 2 does)",
        ),
        (lambda p: p.__setitem__("profile", {}), "profile: profile (the breakdown summary) was removed"),
        (
            lambda p: p.__setitem__("comm", {k: v for k, v in comm_section(4).items() if k != "cpu_us"}),
            "needs cpu_us",
        ),
        (
            lambda p: p.__setitem__("comm", {**comm_section(4), "arrive_us": [0, 0.5, 0, 0]}),
            "comm.arrive_us.1",
        ),
        (lambda p: p.__setitem__("comm", {**comm_section(4), "version": True}), "comm.version"),
        (lambda p: p.__setitem__("comm", {**comm_section(4), "version": 7}), "comm.version"),
        (
            lambda p: p.__setitem__(
                "comm", {**comm_section(4), "groups": [{"group": "world", "entered": 1, "completed": 2}]}
            ),
            "comm.groups.0",
        ),
        (
            lambda p: p.__setitem__(
                "comm",
                {
                    **comm_section(4),
                    "links": [{"local": -1, "peer": 2, "bytes": 1, "received": 0, "busy_s": 0.1}],
                },
            ),
            "comm.links.0.local",
        ),
    ],
)
def test_bad_payload_rejected_whole_naming_the_field(
    client: TestClient, engine: Engine, mutate, field: str
) -> None:  # type: ignore[no-untyped-def]
    p = payload(world=4)
    mutate(p)
    r = client.post("/api/v1/ingest", json=p)
    assert r.status_code == 422, r.text
    assert field in r.json()["detail"]
    assert _count(engine, JobStep) == 0 and _count(engine, IngestedBatch) == 0


def test_collective_timing_section_is_accepted(client: TestClient, engine: Engine) -> None:
    """The agent's ``comm`` section (not stored yet) rides on a batch that is stored whole."""
    p = payload(world=4, comm=comm_section(4))
    assert p["comm"]["collectives"][0]["count"] == 32
    r = client.post("/api/v1/ingest", json=p)
    assert r.status_code == 200, r.text
    assert _count(engine, JobStep) == 4


def test_an_h200_ranks_batches_with_device_timing_are_stored(client: TestClient, engine: Engine) -> None:
    """Batches a DDP rank on an H200 encoded (``tools/gpu_check.py --keep``, its ``ddp``
    check; tests/fixtures/h200): steps on the CUDA events' clock, the ``comm`` section on
    the device clock, then the closing window's empty batch. What a GPU rank sends is
    what the collector accepts, whole."""
    batches = json.loads((FIXTURES / "h200" / "ddp_rank0_batches.json").read_text())
    assert (batches[0]["agent"]["clock"], batches[0]["comm"]["clock"]) == ("cuda_events", "device")
    for b in batches:
        r = client.post("/api/v1/ingest", json=b)
        assert r.status_code == 200, r.text
    assert _count(engine, IngestedBatch) == 2
    assert _count(engine, JobStep) == sum(len(b["steps"]["time_s"]) for b in batches) == 32


def test_body_too_large_is_413(client: TestClient) -> None:
    p = payload(times=[0.1] * 9000)
    r = client.post("/api/v1/ingest", json=p)
    assert r.status_code == 413
    assert "larger than" in r.json()["detail"]


def test_unknown_run_and_metric_are_404(client: TestClient) -> None:
    assert client.get("/api/v1/runs/nope").status_code == 404
    client.post("/api/v1/ingest", json=payload())
    r = client.get("/api/v1/runs/test-run/series", params={"metric": "bogus"})
    assert r.status_code == 404 and "bogus" in r.json()["detail"]


def test_mfu_without_a_peak_is_an_empty_series_with_the_reason(client: TestClient) -> None:
    client.post("/api/v1/ingest", json=payload(convention={**CONVENTION, "peak_flops": None}))
    r = client.get("/api/v1/runs/test-run/series", params={"metric": "mfu"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["points"] == [] and "peak_flops=" in body["reason"] and "finding a peak" in body["reason"]
    assert client.get("/api/v1/runs/test-run").json()["mfu_unavailable"] == body["reason"]
    assert (
        client.get("/api/v1/runs/test-run/series", params={"metric": "step_time_s"}).json()["reason"] is None
    )


def test_run_status_live_stalled_hung_finished(client: TestClient, engine: Engine) -> None:
    def status(run: str) -> tuple[str, str]:
        listed = {r["name"]: r for r in client.get("/api/v1/runs").json()}
        ov = client.get(f"/api/v1/runs/{run}").json()
        assert ov["status"] == listed[run]["status"] and ov["last_seen"] == listed[run]["last_seen"]
        return ov["status"], ov["last_seen"]

    now = time.time()
    client.post("/api/v1/ingest", json=payload(run="fresh", rank=0, world=2, wall_end=now))
    client.post("/api/v1/ingest", json=payload(run="quiet", rank=0, world=2, wall_end=now - 300))
    fresh, seen = status("fresh")
    assert fresh == "live"
    assert datetime.fromisoformat(seen) == datetime.fromtimestamp(now, timezone.utc)  # ISO-8601, UTC
    assert seen.endswith("Z") or seen.endswith("+00:00")
    assert status("quiet")[0] == "stalled"  # 300 s without a step, 0.5 s steps: past the 60 s floor
    with engine.begin() as conn:
        run_id = conn.execute(select(Run.id).where(Run.name == "quiet")).scalar_one()
        at = datetime.now(timezone.utc)
        conn.execute(
            Event.__table__.insert().values(
                run_id=run_id, key="hang", kind="hang", cause=None, ranks=[0], hosts=["node0"],
                first_step=4, last_step=4, status="open", evidence={}, cost_seconds=0.0, cost_ratio=0.0,
                message="hang", opened_at=at, updated_at=at,
            )
        )  # fmt: skip
    assert status("quiet")[0] == "hung"
    client.post("/api/v1/ingest", json=payload(run="fresh", rank=0, world=2, first=5, times=[], final=True))
    assert status("fresh")[0] == "live"  # one of two ranks finished
    client.post("/api/v1/ingest", json=payload(run="fresh", rank=1, world=2, wall_end=now))
    client.post("/api/v1/ingest", json=payload(run="fresh", rank=1, world=2, first=5, times=[], final=True))
    assert status("fresh")[0] == "finished"


def test_series_downsampling_keeps_true_min_mean_max(client: TestClient) -> None:
    times = [0.1 * (1 + (i % 10)) for i in range(100)]  # 0.1 .. 1.0 repeating
    client.post("/api/v1/ingest", json=payload(times=times, tokens=[100] * 100))
    s = client.get("/api/v1/runs/test-run/series", params={"metric": "step_time_s", "max_points": 10}).json()
    assert s["unit"] == "s"
    assert len(s["points"]) == 10
    for pt in s["points"]:
        assert pt["count"] == 10
        assert pt["min"] == pytest.approx(0.1)
        assert pt["max"] == pytest.approx(1.0)
        assert pt["mean"] == pytest.approx(0.55)
    sub = client.get(
        "/api/v1/runs/test-run/series",
        params={"metric": "tokens_per_s", "from_step": 11, "to_step": 20, "max_points": 1},
    ).json()
    assert sub["points"][0]["step_from"] == 11 and sub["points"][0]["step_to"] == 20
    assert sub["points"][0]["max"] == pytest.approx(1000.0)
    assert sub["points"][0]["min"] == pytest.approx(100.0)
    mfu = client.get("/api/v1/runs/test-run/series", params={"metric": "mfu", "max_points": 1}).json()
    assert mfu["points"][0]["max"] == pytest.approx(1000.0 * 1e9 / 1e14)


def test_window_split_across_batches_adds_up(client: TestClient, engine: Engine) -> None:
    # window_seconds=2 and 0.5 s steps -> 4 steps per stored window.
    client.post("/api/v1/ingest", json=payload(first=1, times=[0.5] * 6, tokens=[10] * 6))
    client.post("/api/v1/ingest", json=payload(first=7, times=[0.5] * 6, tokens=[10] * 6))
    with engine.connect() as conn:
        rows = conn.execute(
            select(
                RankWindow.window,
                RankWindow.first_step,
                RankWindow.last_step,
                RankWindow.n_steps,
                RankWindow.tokens_sum,
            ).order_by(RankWindow.window)
        ).all()
    assert [tuple(r) for r in rows] == [(0, 1, 4, 4, 40), (1, 5, 8, 4, 40), (2, 9, 12, 4, 40)]


def test_tagged_steps_are_kept_out_of_the_mean(client: TestClient) -> None:
    times = [5.0, 5.0, 0.5, 0.5, 0.5, 0.5]
    client.post(
        "/api/v1/ingest", json=payload(times=times, tags=["warmup", "warmup", None, None, None, None])
    )
    ov = client.get("/api/v1/runs/test-run").json()
    assert ov["step_time_s"]["mean"] == pytest.approx(0.5)
    assert ov["steps_stored"] == 6


def test_padding_ratio(client: TestClient) -> None:
    client.post("/api/v1/ingest", json=payload(times=[0.5] * 4, tokens=[750] * 4, padded=[1000] * 4))
    assert client.get("/api/v1/runs/test-run").json()["padding_ratio"] == pytest.approx(0.25)


def test_partial_step_is_scaled_to_all_replicas(client: TestClient) -> None:
    # Only 2 of 4 data-parallel ranks have reported: tokens/s is still the job's estimate.
    for rank in range(2):
        client.post("/api/v1/ingest", json=payload(rank=rank, world=4, times=[1.0] * 4, tokens=[500] * 4))
    ov = client.get("/api/v1/runs/test-run").json()
    assert ov["tokens_per_s"]["latest"] == pytest.approx(2000.0)


def test_health_ready_metrics_openapi(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    client.post("/api/v1/ingest", json=payload(times=[0.1] * 3))
    text = client.get("/metrics").text
    assert 'stepwatch_ingest_batches_total{outcome="stored"} 1.0' in text
    assert "stepwatch_ingest_rank_steps_total 3.0" in text
    spec = client.get("/openapi.json").json()
    assert {
        "/api/v1/ingest",
        "/api/v1/runs",
        "/api/v1/runs/{run}",
        "/api/v1/runs/{run}/series",
        "/api/v1/runs/{run}/ranks",
    } <= set(spec["paths"])


def test_events_are_served_newest_first_and_filtered(client: TestClient, engine: Engine) -> None:
    from datetime import datetime, timezone

    from stepwatch_server.storage.models import Event, Run

    client.post("/api/v1/ingest", json=payload(world=4, rank=2))
    now = datetime.now(timezone.utc)
    with engine.begin() as conn:
        run_id = conn.execute(select(Run.id)).scalar_one()
        for first, status in ((100, "closed"), (300, "open")):
            conn.execute(
                Event.__table__.insert().values(
                    run_id=run_id,
                    key="straggler:compute:rank=2",
                    kind="straggler",
                    cause="compute",
                    ranks=[2],
                    hosts=["node0"],
                    first_step=first,
                    last_step=first + 50,
                    status=status,
                    evidence={"compute_s": 0.31, "peer_median_s": 0.22},
                    cost_seconds=0.09,
                    cost_ratio=0.081,
                    message="Rank 2 is a compute straggler.",
                    opened_at=now,
                    updated_at=now,
                )
            )
    events = client.get("/api/v1/runs/test-run/events").json()
    assert [e["first_step"] for e in events] == [300, 100]
    assert events[0]["evidence"] == {"compute_s": 0.31, "peer_median_s": 0.22}
    open_only = client.get("/api/v1/runs/test-run/events", params={"status": "open"}).json()
    assert [e["status"] for e in open_only] == ["open"]
    assert client.get("/api/v1/runs/test-run/events", params={"status": "maybe"}).status_code == 422


def test_a_fixed_window_size_is_every_new_runs_whatever_its_pace(db_url: str, engine: Engine) -> None:
    settings = Settings(database_url=db_url, window_seconds=2.0, window_steps=16)
    with TestClient(create_app(settings, engine=engine)) as c:
        for run, pace in (("fast", 0.01), ("slow", 5.0)):  # chosen: 256 and 1 steps
            r = c.post("/api/v1/ingest", json=payload(run=run, times=[pace] * 4, tokens=[10] * 4))
            assert r.status_code == 200, r.text
    with engine.connect() as conn:
        assert dict(conn.execute(select(Run.name, Run.window_steps)).all()) == {"fast": 16, "slow": 16}
    with pytest.raises(ValueError, match="power of two"):
        Settings(database_url=db_url, window_steps=24)


def test_ranks_spread_over_many_windows_each_show_their_newest(db_url: str, engine: Engine) -> None:
    """``/ranks`` reads the few windows most ranks are in as index ranges and probes the
    others (``queries.rank_rows``): with every rank in a window of its own, more than
    those few, each still shows its newest window, its means the stored sums divided as
    Python divides them, and its last_seen the stored time as ``unix()`` reads it."""
    world = queries.COMMON_WINDOWS + 3
    settings = Settings(database_url=db_url, window_steps=4)
    with TestClient(create_app(settings, engine=engine)) as c:
        for rank in range(world):
            # Rank r reaches window r; its newest window's steps take 0.1 x (r + 1) s.
            times = [0.5] * (4 * rank) + [0.1 * (rank + 1)] * 4
            tokens = [1000] * (4 * rank) + [333 * (rank + 1)] * 4
            r = c.post("/api/v1/ingest", json=payload(rank=rank, world=world, times=times, tokens=tokens))
            assert r.status_code == 200, r.text
        served = c.get("/api/v1/runs/test-run/ranks").json()
    with engine.connect() as conn:
        newest = {w.rank: w for w in conn.execute(select(RankWindow).order_by(RankWindow.window)).all()}
        seen = dict(conn.execute(select(Rank.rank, Rank.last_seen)).all())
    assert [r["window"] for r in served] == list(range(world))
    for r in served:
        w = newest[r["rank"]]
        assert (r["window_first_step"], r["window_last_step"]) == (w.first_step, w.last_step)
        assert r["step_time_s"] == w.step_time_sum / w.n_steps
        assert r["data_wait_s"] == w.data_wait_sum / w.n_steps
        assert r["tokens_per_s"] == w.tokens_sum / w.step_time_sum
        assert r["step_time_max_s"] == w.step_time_max
        assert r["last_seen"] == unix(seen[r["rank"]])


def test_a_run_whose_first_batches_show_no_pace_takes_its_window_from_the_first_that_does(
    db_url: str, engine: Engine
) -> None:
    """A heartbeat (compilation still running) and then the first step alone (40 s) are a
    run's first batches: sized from them its windows would hold one step for the whole
    run. The size waits as a placeholder and settles on the first batch timing a later
    step (0.5 s a step, 8 s windows: 16 steps), and step 1 stored before lands in window 0
    with the 15 steps after it; the analysis leaves the run alone meanwhile."""
    settings = Settings(database_url=db_url, window_seconds=8.0, analysis_enabled=False)
    with TestClient(create_app(settings, engine=engine)) as c:

        def post(body: dict[str, object]) -> None:
            r = c.post("/api/v1/ingest", json=body)
            assert r.status_code == 200, r.text

        def window() -> tuple[int, bool]:
            with engine.connect() as conn:
                row = conn.execute(select(Run.window_steps, Run.window_provisional)).one()
            return int(row[0]), bool(row[1])

        # The agent's own heartbeat while its rank is inside its first step: DDP's first
        # collective entered, nothing completed.
        timing = CommTiming(1, lambda: (1, 0))
        timing.arrive("world", 0, 4096)
        beat = payload(run="slow-start", rank=0, world=2, times=[], comm=timing.heartbeat_section(30.0))
        beat["heartbeat"] = True
        post(beat)
        post(payload(run="slow-start", rank=1, world=2, times=[40.0]))
        assert window() == (1, True)
        post(payload(run="slow-start", rank=0, world=2, times=[40.0] + [0.5] * 15))
        assert window() == (16, False)
        post(payload(run="slow-start", rank=1, world=2, first=2, times=[0.5] * 15))
        post(payload(run="slow-start", rank=1, world=2, first=17, times=[0.01] * 4))  # settled once
        assert window() == (16, False)
        # The settled size is what ingest caches: later batches fold once, with it.
        key = c.app.state.ingestor.cached("slow-start")  # type: ignore[attr-defined]
        assert (key.window_steps, key.window_provisional) == (16, False)
    with engine.connect() as conn:
        rows = conn.execute(
            select(RankWindow.rank, RankWindow.window, RankWindow.first_step, RankWindow.last_step).order_by(
                RankWindow.rank, RankWindow.window
            )
        ).all()
    assert [tuple(r) for r in rows] == [(0, 0, 1, 16), (1, 0, 1, 16), (1, 1, 17, 20)]
