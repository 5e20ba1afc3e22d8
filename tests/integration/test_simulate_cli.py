"""``stepwatch simulate`` against a real collector served on loopback."""

from __future__ import annotations

import httpx
import pytest

from stepwatch.cli import main

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


def test_bad_fault_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--fault", "meteor:rank=1", "--no-progress"]) == 2
    assert "unknown fault" in capsys.readouterr().out
