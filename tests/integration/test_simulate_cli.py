"""``stepwatch simulate`` against a real collector served on loopback."""

from __future__ import annotations

import httpx
import pytest
from sqlalchemy import Engine, select

from stepwatch.cli import main
from stepwatch.simulate import Fault, Simulation, TimingModel, Topology
from stepwatch_server.storage.models import RankWindow

from ..live import serve_in_thread


def test_help_lists_the_faults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for word in ("compute:rank=R,at=W", "link:", "data:", "host:host=H", "mfu:at=W", "hang:", "silent:"):
        assert word in out


def test_simulate_sends_every_rank_and_reports_what_the_collector_found(
    db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with serve_in_thread(db_url, window_seconds=32.0, analysis_interval_s=0.2) as url:
        rc = main(
            [
                "simulate",
                "--url", url,
                "--run", "cli-sim",
                "--hosts", "2",
                "--ranks-per-host", "4",
                "--windows", "7",
                "--window-seconds", "32",
                "--fault", "data:rank=6,at=2",
                "--target-tokens", "1e12",
                "--deadline-days", "30",
                "--no-progress",
                "--wait", "20",
            ]
        )  # fmt: skip
        ov = httpx.get(f"{url}/api/v1/runs/cli-sim").json()
    out = capsys.readouterr().out
    assert rc == 0
    assert "8 ranks on 2 hosts" in out and "sent 56 of 56 batches" in out
    assert "Rank 6 (host sim-n0001) is a data straggler since step 33" in out
    assert (ov["world_size"], ov["window_steps"], ov["last_step"]) == (8, 16, 7 * 16)
    assert ov["plan"]["target_tokens"] == 10**12
    progress = ov["progress"]
    assert progress["calendar_efficiency"] == pytest.approx(1.0, abs=0.02)  # no pauses in 112 steps
    assert progress["eta_s"] > 0 and progress["required_step_time_s"] > 0


def test_simulated_profiles_enter_by_the_agents_path_and_store_the_models_breakdown(
    db_url: str, engine: Engine
) -> None:
    """v2 ``profiles`` through the payload builder, Sender and HTTP: the collector's own
    wait/transfer split and communicator typing give back the model's numbers (as shares of
    the step: each profiled step carries the window means scaled to its step time)."""
    topo = Topology(hosts=2, ranks_per_host=4, tp=2, pp=2)  # dp 2
    faults = [Fault("link", at=0, target=3, mag=1.0)]
    model = TimingModel(topo, steps_per_window=16, faults=faults, seed=5)
    with serve_in_thread(db_url, window_seconds=32.0) as url:
        result = Simulation(model, url=url, run="sim-v2", senders=2).run_windows(2)
    assert result.rejected_batches == 0 and result.sent_batches == 2 * topo.world
    expected = list(TimingModel(topo, steps_per_window=16, faults=faults, seed=5).windows(2))
    with engine.connect() as conn:
        rows = conn.execute(select(RankWindow.__table__).order_by(RankWindow.window, RankWindow.rank)).all()
    assert len(rows) == 2 * topo.world
    for row in rows:
        wt = expected[row.window]
        t = wt.ranks[row.rank]
        share = (
            sum(wt.step_time_s)
            / 16
            / (t.compute_s + t.comm_overlapped_s + t.comm_exposed_s + t.data_wait_s + t.idle_s)
        )
        assert (row.profiled_steps, row.skew_steps) == (16, 16)
        assert row.compute_s == pytest.approx(t.compute_s * share, rel=1e-6)
        assert row.comm_wait_s == pytest.approx(t.comm_wait_s * share, abs=1e-6)
        assert row.comm_transfer_s == pytest.approx(t.comm_transfer_s * share, rel=1e-5)
        assert row.group_transfer_s == pytest.approx(
            {k: v * share for k, v in t.group_transfer_s.items()}, rel=1e-5
        )
    # Rank 3's slow link shows in each of its groups (every member sees it), and only there.
    slow = rows[3].group_transfer_s
    for row in rows[: topo.world]:
        for gtype in topo.group_types:
            shared = topo.group_id(row.rank, gtype) == topo.group_id(3, gtype)
            assert (row.group_transfer_s[gtype] == pytest.approx(slow[gtype])) == shared


def test_bad_fault_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--fault", "meteor:rank=1", "--no-progress"]) == 2
    assert "unknown fault" in capsys.readouterr().out
