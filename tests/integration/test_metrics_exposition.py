"""/metrics from the database: values, selection, expiry, caps and failure (both backends)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from sqlalchemy import Engine, Float, cast, func, select

from stepwatch_server.app import create_app
from stepwatch_server.exporter import ExporterConfig, RunStateCollector, state
from stepwatch_server.exporter.collector import CENSUS_MAX_AGE_S
from stepwatch_server.ingest.store import Ingestor
from stepwatch_server.settings import Settings
from stepwatch_server.storage.backend import open_storage
from stepwatch_server.storage.engine import make_engine
from stepwatch_server.storage.models import RankWindow

from ..payloads import CONVENTION
from ..runstate import feed, fill_breakdown, open_straggler, run_id, store

RW = RankWindow.__table__


def registry(
    engine: Engine, clock: Callable[[], float] | None = None, **cfg: int | float
) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=True)
    kwargs = {"clock": clock} if clock else {}
    reg.register(RunStateCollector(engine, ExporterConfig(**cfg), **kwargs))  # type: ignore[arg-type]
    return reg


@pytest.fixture
def ingestor(engine: Engine) -> Ingestor:
    return Ingestor(open_storage(engine), window_seconds=2.0)  # 0.5 s steps -> 4 steps per window


def test_run_values_match_the_rest_overview(engine: Engine, db_url: str, ingestor: Ingestor) -> None:
    feed(ingestor, run="r1", world=4, first=1, steps=4, tags=["warmup"] * 4)
    for w in range(1, 8):
        feed(ingestor, run="r1", world=4, first=1 + 4 * w, steps=4, wait=lambda r: 0.01 * r, padded=1250)
    reg = registry(engine)
    app = create_app(Settings(database_url=db_url), engine=engine)
    with TestClient(app) as client:
        ov = client.get("/api/v1/runs/r1").json()
    v = reg.get_sample_value
    run = {"run": "r1"}
    assert v("stepwatch_run_step_time_seconds", run) == pytest.approx(ov["step_time_s"]["latest"])
    assert v("stepwatch_run_tokens_per_second", run) == pytest.approx(ov["tokens_per_s"]["latest"])
    assert v("stepwatch_run_mfu_ratio", run) == pytest.approx(ov["mfu"]["latest"])
    assert v("stepwatch_run_data_wait_seconds", run) == pytest.approx(0.03)
    assert v("stepwatch_run_padding_ratio", run) == pytest.approx(0.2)
    assert v("stepwatch_run_steps_total", run) == 32
    assert v("stepwatch_run_world_size_ranks", run) == 4
    assert v("stepwatch_run_reporting_ranks", run) == 4
    # Tokens lag two windows (8 steps) behind the newest step and never go back.
    assert v("stepwatch_run_tokens_total", run) == pytest.approx(4 * 1000 * (32 - 16))
    assert v("stepwatch_run_tagged_steps", {"run": "r1", "tag": "warmup"}) == 4
    assert v("stepwatch_run_baseline_step_time_seconds", run) == pytest.approx(0.5)
    assert v("stepwatch_run_hang_threshold_seconds", run) == pytest.approx(60.0)
    info = {"run": "r1", "convention": CONVENTION["id"], "formula": "explicit", "dtype": "bf16"}
    assert v("stepwatch_run_info", {**info, "device": "test-device", "peak_source": "user"}) == 1
    feed(ingestor, run="r1", world=4, first=33, steps=8)
    assert v("stepwatch_run_tokens_total", run) == pytest.approx(4 * 1000 * (40 - 16))


def test_a_finished_run_exports_every_token_and_its_status(engine: Engine, db_url: str) -> None:
    """A 100-step run that finished (every rank's final batch) counts its last two
    windows too, so Grafana's tokens done equals the API's total (it stayed lagging)."""
    ingestor = Ingestor(open_storage(engine), window_seconds=32.0)  # 0.5 s steps -> 64-step windows
    for first in range(1, 101, 10):
        feed(ingestor, run="done", world=2, first=first, steps=10, tokens=1024)
    reg = registry(engine)
    v = reg.get_sample_value
    assert v("stepwatch_run_status", {"run": "done", "status": "live"}) == 1
    assert v("stepwatch_run_tokens_total", {"run": "done"}) == 0  # still stepping: two windows behind
    for rank in range(2):
        store(ingestor, run="done", rank=rank, world=2, first=101, times=[], final=True)
    app = create_app(Settings(database_url=db_url), engine=engine)
    with TestClient(app) as client:
        ov = client.get("/api/v1/runs/done").json()
        listed = client.get("/api/v1/runs").json()
    assert ov["tokens_total"] == 2 * 1024 * 100
    assert v("stepwatch_run_tokens_total", {"run": "done"}) == ov["tokens_total"]
    assert ov["status"] == listed[0]["status"] == "finished" and ov["ranks_finished"] == 2
    assert v("stepwatch_run_status", {"run": "done", "status": "finished"}) == 1
    assert v("stepwatch_run_status", {"run": "done", "status": "live"}) == 0


def test_flagged_and_slowest_ranks_get_their_own_series(engine: Engine, ingestor: Ingestor) -> None:
    for w in range(3):
        feed(ingestor, run="r2", world=16, first=1 + 4 * w, steps=4)
    # Rank 6 computes longer and waits less (a compute straggler); rank 11 is flagged for data.
    fill_breakdown(
        engine, "r2", compute=lambda r: 0.40 if r == 6 else 0.30, comm_wait=lambda r: 0.0 if r == 6 else 0.1
    )
    open_straggler(engine, "r2", rank=11, host="node1", cost_seconds=0.05, cost_ratio=0.1, cause="data")
    reg = registry(engine, top_k=1, max_flagged=4)
    v = reg.get_sample_value
    r6 = {"run": "r2", "rank": "6", "Hostname": "node0", "gpu": "6"}
    r11 = {"run": "r2", "rank": "11", "Hostname": "node1", "gpu": "3"}
    assert v("stepwatch_rank_compute_seconds", r6) == pytest.approx(0.40)
    assert v("stepwatch_rank_comm_wait_seconds", r6) == pytest.approx(0.0)
    assert v("stepwatch_rank_step_time_seconds", r11) == pytest.approx(0.5)
    assert v("stepwatch_straggler_cost_ratio", {**r11, "cause": "data"}) == pytest.approx(0.1)
    assert v("stepwatch_run_open_events", {"run": "r2", "kind": "straggler", "cause": "data"}) == 1
    assert v("stepwatch_run_events_total", {"run": "r2", "kind": "straggler"}) == 1
    ranks = {
        s.labels["rank"]
        for fam in reg.collect()
        if fam.name == "stepwatch_rank_step_time_seconds"
        for s in fam.samples
    }
    assert ranks == {"6", "11"}  # top-1 by compute, plus the flagged rank; not the other 14
    # All 16 ranks enter the quantiles.
    assert v("stepwatch_run_rank_compute_seconds_count", {"run": "r2"}) == 16
    assert v("stepwatch_run_rank_compute_seconds", {"run": "r2", "quantile": "1.0"}) == pytest.approx(0.40)
    assert v("stepwatch_run_rank_comm_wait_seconds", {"run": "r2", "quantile": "0.5"}) == pytest.approx(0.1)
    assert v("stepwatch_run_breakdown_seconds", {"run": "r2", "phase": "comm_exposed"}) == pytest.approx(0.05)
    assert v("stepwatch_run_overlap_ratio", {"run": "r2"}) == pytest.approx(0.10 / 0.15)


def test_runs_expire_and_are_capped(engine: Engine, ingestor: Ingestor) -> None:
    for name in ("old", "mid", "new"):
        feed(ingestor, run=name, world=2, first=1, steps=4)
    import time

    now = [time.time()]
    reg = registry(engine, clock=lambda: now[0], max_runs=2, run_expiry_s=600)
    v = reg.get_sample_value
    exported = {
        s.labels["run"]
        for f in reg.collect()
        if f.name == "stepwatch_run_world_size_ranks"
        for s in f.samples
    }
    assert exported == {"mid", "new"}  # the two most recently reporting
    assert v("stepwatch_metrics_runs", {"state": "active"}) == 3
    assert v("stepwatch_metrics_runs", {"state": "exported"}) == 2
    now[0] += 601
    assert v("stepwatch_metrics_runs", {"state": "active"}) == 0
    assert v("stepwatch_run_world_size_ranks", {"run": "new"}) is None


def test_database_down_keeps_the_endpoint_up() -> None:
    engine = make_engine("postgresql://nobody@127.0.0.1:1/none")
    try:
        reg = registry(engine)
        assert reg.get_sample_value("stepwatch_metrics_state_up") == 0
        assert reg.get_sample_value("stepwatch_metrics_runs", {"state": "exported"}) == 0
    finally:
        engine.dispose()


def test_quantiles_and_top_k_across_ranks_come_from_the_database(engine: Engine, ingestor: Ingestor) -> None:
    """Without a profiler the slowest ranks are picked by step time, ties to the lower
    rank, and the quantiles are those of every rank's value (the database returns only
    the order statistics they interpolate between)."""
    times = {r: 0.25 + (r * 7 % 11) / 64 for r in range(40)}  # ties: ranks r and r + 11
    for w in range(3):
        feed(ingestor, run="q", world=40, first=1 + 4 * w, steps=4, step_time=lambda r: times[r])
    reg = registry(engine, top_k=3)
    v = reg.get_sample_value
    exported = {
        int(s.labels["rank"])
        for fam in reg.collect()
        if fam.name == "stepwatch_rank_step_time_seconds"
        for s in fam.samples
    }
    expected = sorted(times, key=lambda r: (-times[r], r))[:3]
    assert exported == set(expected) and len(set(times[r] for r in expected)) < 3  # a tie broken
    for q, want in state.quantiles(list(times.values())):
        got = v("stepwatch_run_rank_step_time_seconds", {"run": "q", "quantile": str(q)})
        assert got == pytest.approx(want)
    assert v("stepwatch_run_rank_step_time_seconds_count", {"run": "q"}) == 40
    assert v("stepwatch_run_rank_step_time_seconds_sum", {"run": "q"}) == pytest.approx(sum(times.values()))


def test_a_run_in_its_first_window_exports_its_quantiles_exactly(engine: Engine, ingestor: Ingestor) -> None:
    """A run whose window before the newest has no row (it starts at step 5) exports
    the quantiles of its newest window, read only because the previous one is empty:
    exactly those of each rank's ``step_time_sum / n_steps`` (the database divides and
    interpolates in floating point as ``state.quantiles`` does)."""
    times = {r: 0.25 + r / 97 for r in range(13)}
    feed(ingestor, run="late", world=13, first=5, steps=3, step_time=lambda r: times[r])
    with engine.connect() as conn:
        rows = conn.execute(
            select(RW.c.step_time_sum, RW.c.n_steps).where(RW.c.run_id == run_id(engine, "late"))
        ).all()
    means = [s / n for s, n in rows]
    assert len(means) == 13
    v = registry(engine).get_sample_value
    for q, want in state.quantiles(means):
        assert v("stepwatch_run_rank_step_time_seconds", {"run": "late", "quantile": str(q)}) == want
    assert v("stepwatch_run_rank_step_time_seconds_count", {"run": "late"}) == 13
    assert v("stepwatch_run_rank_step_time_seconds_sum", {"run": "late"}) == pytest.approx(sum(means))


def test_slowest_ranks_by_compute_are_the_largest_ties_to_the_lower_rank(
    engine: Engine, ingestor: Ingestor
) -> None:
    """The top-K by compute time comes from the order of the profiled rows' index
    (compute descending, then rank): three ranks tie for the largest, and the two lower
    ones are exported, with their values."""
    for w in range(3):
        feed(ingestor, run="tk", world=16, first=1 + 4 * w, steps=4)
    compute = {13: 0.40, 3: 0.40, 9: 0.40, 12: 0.35}
    fill_breakdown(engine, "tk", compute=lambda r: compute.get(r, 0.30), comm_wait=lambda r: 0.1)
    reg = registry(engine, top_k=2, max_flagged=0)
    exported = {
        int(s.labels["rank"]): s.value
        for fam in reg.collect()
        if fam.name == "stepwatch_rank_compute_seconds"
        for s in fam.samples
    }
    assert exported == {3: pytest.approx(0.40), 9: pytest.approx(0.40)}


def test_breakdown_means_are_the_averages_over_the_profiled_ranks(engine: Engine, ingestor: Ingestor) -> None:
    """The exported parts of the step are each part's mean over the profiled ranks, a
    missing part counting as zero: the database's ``avg(coalesce(part, 0))``, which the
    reader computes as a sum divided by the ranks (to the last bits only: the two
    queries may add the rows in different orders)."""
    for w in range(3):
        feed(ingestor, run="bd", world=7, first=1 + 4 * w, steps=4, wait=lambda r: 0.01 * r)
    window = fill_breakdown(
        engine, "bd", compute=lambda r: 0.3 + r / 97, comm_wait=lambda r: 0.1, idle=0.02 + 1 / 3
    )
    rid = run_id(engine, "bd")
    at = (RW.c.run_id == rid) & (RW.c.window == window)
    with engine.begin() as conn:
        conn.execute(RW.update().where(at, RW.c.rank.in_([2, 5])).values(idle_s=None))
        expected = conn.execute(
            select(
                func.avg(func.coalesce(RW.c.compute_s, 0.0)),
                func.avg(func.coalesce(RW.c.comm_overlapped_s, 0.0)),
                func.avg(func.coalesce(RW.c.comm_exposed_s, 0.0)),
                func.avg(RW.c.data_wait_sum / cast(RW.c.n_steps, Float)),
                func.avg(func.coalesce(RW.c.idle_s, 0.0)),
            ).where(at)
        ).one()
    v = registry(engine).get_sample_value
    for phase, want in zip(state.PHASES, expected, strict=True):
        got = v("stepwatch_run_breakdown_seconds", {"run": "bd", "phase": phase})
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15), phase


def test_the_complete_windows_census_is_read_again_only_when_a_rank_stores_a_step_of_it(
    engine: Engine, ingestor: Ingestor
) -> None:
    """The quantiles, totals and slowest ranks of the complete window are kept between
    scrapes while ``job_steps`` shows no new step of it, for at most ``CENSUS_MAX_AGE_S``,
    and read again once a late rank stores its steps there. A write that bypasses ingest
    (as ``db prune`` does; here made to tell a kept census from a re-read one) is seen only
    after that age or the next step stored in the window."""
    times = {r: 0.44 + r / 200 for r in range(12)}  # 4-step windows (the fixture)
    late = 11
    for w in range(3):  # windows 0-2; the late rank has sent window 0 only
        ranks = range(12) if w == 0 else range(late)
        feed(ingestor, run="c", world=12, first=1 + 4 * w, steps=4, step_time=lambda r: times[r], ranks=ranks)
    now = [time.time()]
    reg = registry(engine, clock=lambda: now[0], top_k=2, max_flagged=0)
    v = reg.get_sample_value

    def scrape() -> tuple[float | None, float | None, set[int]]:
        families = list(reg.collect())
        selected = {
            int(s.labels["rank"])
            for fam in families
            if fam.name == "stepwatch_rank_step_time_seconds"
            for s in fam.samples
        }
        return (
            v("stepwatch_run_rank_step_time_seconds_count", {"run": "c"}),
            v("stepwatch_run_rank_step_time_seconds_sum", {"run": "c"}),
            selected,
        )

    assert scrape() == (11, pytest.approx(sum(times[r] for r in range(late))), {9, 10})
    median = v("stepwatch_run_rank_step_time_seconds", {"run": "c", "quantile": "0.5"})
    assert median == pytest.approx(times[5])
    with engine.begin() as conn:  # rank 0's window 1 made the slowest, behind ingest's back
        conn.execute(
            RW.update()
            .where(RW.c.run_id == run_id(engine, "c"), RW.c.rank == 0, RW.c.window == 1)
            .values(step_time_sum=RW.c.step_time_sum * 20)
        )
    assert scrape() == (11, pytest.approx(sum(times[r] for r in range(late))), {9, 10})
    assert v("stepwatch_run_rank_step_time_seconds", {"run": "c", "quantile": "1.0"}) == times[10]
    now[0] += CENSUS_MAX_AGE_S  # kept no longer than that: the change shows
    tampered = sum(times[r] for r in range(1, late)) + 20 * times[0]
    assert scrape() == (11, pytest.approx(tampered), {0, 10})
    feed(ingestor, run="c", world=12, first=5, steps=4, step_time=lambda r: 0.9, ranks=[late])
    count, total, selected = scrape()
    assert count == 12 and selected == {0, late}
    assert total == pytest.approx(sum(times[r] for r in range(1, late)) + 20 * times[0] + 0.9)
    for q, want in state.quantiles([20 * times[0], *(times[r] for r in range(1, late)), 0.9]):
        got = v("stepwatch_run_rank_step_time_seconds", {"run": "c", "quantile": str(q)})
        assert got == pytest.approx(want)
