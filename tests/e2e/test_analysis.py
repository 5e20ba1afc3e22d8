"""End to end: faults in real gloo training (or the simulator) are flagged by a real
collector process, read back from ``GET /api/v1/runs/{run}/events``.

- loader stall, then a hang, in one gloo run: rank 2's data loader is slow -> a data
  straggler naming rank 2; later rank 1 stops inside a step and the others block in the
  all-reduce -> a run hang (that a run that finishes cleanly is no hang is tested in
  tests/integration/test_worker.py with the agent's real final batches);
- compute straggler: needs the profiler's ``compute_s``, which this branch's agent does
  not measure yet, so it runs through the simulator (the agent's real payload builder
  and sender, a real collector process). Switch it to ``--slow-rank`` gloo training once
  the profiler window fills ``compute_s``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from stepwatch.demo import launch
from stepwatch.simulate import Simulation, TimingModel, Topology, parse_fault

from ..wait import wait_until

RANKS = 4
FAST_ANALYSIS = {
    "STEPWATCH_ANALYSIS_INTERVAL_S": "0.3",
    "STEPWATCH_ANALYSIS_GRACE_S": "5",
    "STEPWATCH_HANG_FLOOR_S": "2",
    "STEPWATCH_HANG_STARTUP_S": "30",
}


def _poll(url: str, path: str, until: Any, timeout_s: float) -> Any:
    """GET ``path`` until ``until(json)`` is truthy; returns that answer."""
    with httpx.Client(base_url=url, timeout=5.0) as c:

        def answer() -> Any:
            r = c.get(path)
            return r.json() if r.status_code == 200 and until(r.json()) else None

        return wait_until(answer, f"{path} to answer as expected", timeout_s=timeout_s, every_s=0.2)


def _train_args(run: str, steps: int, *extra: str) -> list[str]:
    return ["--run", run, "--steps", str(steps), "--send-interval", "1", "--warmup-steps", "2", *extra]


@pytest.mark.solo
def test_loader_stall_then_hang_in_real_gloo_training(tmp_path: Path) -> None:
    """One run, two faults (one spawn of torch ranks, to keep the suite fast): rank 2's
    loader stalls from the start, rank 1 hangs at step 24 and the others block."""
    run = "e2e-stall-hang"
    env = {**FAST_ANALYSIS, "STEPWATCH_WINDOW_SECONDS": "0.5"}
    db = f"sqlite:///{tmp_path / 'c.db'}"
    with launch.collector(db, log_path=str(tmp_path / "collector.log"), env=env) as col:
        args = _train_args(
            run,
            60,
            "--stall-rank",
            "2",
            "--stall-ms",
            "120",
            "--hang-rank",
            "1",
            "--hang-step",
            "24",
            "--hang-s",
            "120",
        )
        with launch.ranks(RANKS, args, env={"STEPWATCH_URL": col.url}, log_dir=str(tmp_path)):
            events = _poll(
                col.url,
                f"/api/v1/runs/{run}/events",
                lambda evs: any(e["key"] == "hang:run" and e["status"] == "open" for e in evs),
                90,
            )
            ranks = httpx.get(f"{col.url}/api/v1/runs/{run}/ranks").json()
        log = col.log()
    assert "analysis of run" not in log, log

    stragglers = sorted(
        (e for e in events if e["kind"] == "straggler"), key=lambda e: e["evidence"]["opened_window"]
    )
    assert stragglers, events
    first = stragglers[0]
    assert (first["key"], first["cause"], first["ranks"]) == ("straggler:data:rank=2", "data", [2])
    assert first["evidence"]["data_wait_s"] > 5 * first["evidence"]["peer_median_data_wait_s"]
    assert 0 < first["cost_ratio"] < 1 and first["cost_seconds"] > 0.05
    assert "Rank 2" in first["message"] and "data straggler" in first["message"]

    # Under heavy load a rank's sender can lag past this test's 2 s floor before the hang,
    # which may briefly flag that rank alone; the run hang is what must be open.
    (hang,) = [e for e in events if e["key"] == "hang:run"]
    assert hang["status"] == "open" and hang["cost_ratio"] == 1.0
    assert hang["evidence"]["silent_s"] > hang["evidence"]["threshold_s"] >= 2.0
    assert hang["first_step"] <= 23 and all(r["last_step"] <= 23 for r in ranks)
    # Rank 1 hung before its forward: the others wait in DDP's buffer broadcast (rank 0's
    # buffers reached some of them, which went on to the all-reduce) or in the all-reduce.
    # A diagnosis, when the heartbeats made one, names rank 1 alone; otherwise the plain one.
    stuck = hang["evidence"].get("collective")
    if stuck is None:
        assert "has made no step for" in hang["message"], hang["message"]
    else:
        assert stuck["never_entered"] == [1] and hang["ranks"] == [1], hang["message"]
        assert sorted(stuck["waiting"] + stuck["went_past"]) == [0, 2, 3], stuck


def test_compute_straggler_via_simulator(tmp_path: Path) -> None:
    """Simulated ranks, real agent send path, real collector process (see module docstring)."""
    db = f"sqlite:///{tmp_path / 'c.db'}"
    env = {**FAST_ANALYSIS, "STEPWATCH_WINDOW_SECONDS": "32"}
    with launch.collector(db, log_path=str(tmp_path / "collector.log"), env=env) as col:
        model = TimingModel(
            Topology(hosts=2, ranks_per_host=4),
            steps_per_window=16,
            faults=[parse_fault("compute:rank=5,at=2")],
        )
        result = Simulation(model, url=col.url, run="e2e-compute", senders=2).run_windows(8)
        assert (result.sent_batches, result.rejected_batches, result.collector_window_steps) == (64, 0, 16)
        _poll(
            col.url,
            "/api/v1/runs/e2e-compute",
            lambda o: (o.get("analysis") or {}).get("analysed_through_step", 0) >= result.last_step,
            20,
        )
        events = httpx.get(f"{col.url}/api/v1/runs/e2e-compute/events").json()
    (ev,) = events
    assert (ev["key"], ev["cause"], ev["ranks"], ev["hosts"]) == (
        "straggler:compute:rank=5",
        "compute",
        [5],
        ["sim-n0001"],
    )
    assert ev["evidence"]["opened_window"] == 4  # the third faulty window
    assert ev["first_step"] == 2 * 16 + 1
    evidence = ev["evidence"]
    assert evidence["compute_s"] == pytest.approx(1.2 * evidence["peer_median_compute_s"], rel=0.05)
    assert evidence["comm_wait_s"] < evidence["peer_median_comm_wait_s"]  # the others wait for it
    assert ev["cost_ratio"] == pytest.approx(evidence["cost_s"] / evidence["step_time_s"], rel=0.3)
