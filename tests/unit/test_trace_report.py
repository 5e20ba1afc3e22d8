"""``stepwatch trace FILE_OR_DIR...``: the real command on trace files written here
(tests/kineto.py), in a subprocess, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from stepwatch.profiler.report import analyse, render

from ..kineto import GEMM, KinetoTrace, training_trace

S = 10_000.0  # step, µs
LATE = 2_000.0  # rank 1 reaches every all_reduce 2 ms after rank 0
TRANSFER = 3_000.0


def _stepwatch(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stepwatch", "trace", *args], capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def two_ranks(tmp_path: Path) -> Path:
    d = tmp_path / "traces"
    d.mkdir()
    for rank, late in ((0, 0.0), (1, LATE)):
        t = training_trace(
            rank=rank, steps=3, step_us=S, late_us=late, last_arrival_us=LATE, transfer_us=TRANSFER, seed=rank
        )
        t.write(d / (f"rank-{rank}.json.gz" if rank == 0 else f"rank-{rank}.json"))
    (d / "notes.txt").write_text("not a trace")
    return d


def test_a_directory_of_ranks_gives_breakdowns_and_lined_up_collectives(two_ranks: Path) -> None:
    out = _stepwatch(str(two_ranks), "--json")
    assert out.returncode == 0, out.stderr
    rep: dict[str, Any] = json.loads(out.stdout)
    assert [r["rank"] for r in rep["ranks"]] == [0, 1]
    for r in rep["ranks"]:
        assert [s["step"] for s in r["steps"]] == [10, 11, 12]
        for s in r["steps"]:
            parts = sum(
                s[p]
                for p in (
                    "compute_s",
                    "copy_s",
                    "comm_overlapped_s",
                    "comm_exposed_s",
                    "data_wait_s",
                    "idle_s",
                )
            )
            assert parts == pytest.approx(s["time_s"], rel=1e-6)
            assert s["time_s"] == pytest.approx(S * 1e-6, rel=0.05), (
                "the first step too: the GPU lag is attributed"
            )
            assert s["copy_s"] == pytest.approx(0.05 * S * 1e-6, rel=0.05)
        (ar,) = r["collectives"]
        assert (ar["op"], ar["count"], ar["bytes"]) == ("all_reduce", 3, 3 * 2 * (1 << 20))
        assert r["before_window_s"] > 0
    lineup = rep["lineup"]
    assert lineup["0"]["collectives"] == 3 and lineup["1"]["collectives"] == 3
    assert lineup["0"]["wait_s"] == pytest.approx(3 * LATE * 1e-6, rel=1e-3), "rank 0 waits for rank 1"
    assert lineup["1"]["wait_s"] == pytest.approx(0.0, abs=1e-9)
    for r in ("0", "1"):
        assert lineup[r]["transfer_s"] == pytest.approx(3 * TRANSFER * 1e-6, rel=0.05)
    assert rep["unmatched_collectives"] == 0


def test_the_table_names_ranks_parts_and_the_lineup(two_ranks: Path) -> None:
    out = _stepwatch(str(two_ranks / "rank-0.json.gz"), str(two_ranks / "rank-1.json"))
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "rank 0 of 2  (cuda)" in text and "rank 1 of 2  (cuda)" in text
    for word in ("compute", "copy", "comm hidden", "comm exposed", "data wait", "idle", "overlap"):
        assert word in text
    assert "collectives lined up across ranks 0, 1" in text
    row = next(line.split() for line in text.splitlines() if line.split()[:2] == ["0", "all_reduce"])
    assert row[2] == "3" and float(row[3]) == pytest.approx(3 * LATE / 1000, rel=1e-3)


def test_one_rank_without_profiler_steps_is_one_step(tmp_path: Path) -> None:
    t = KinetoTrace(rank=0, world=1)
    t.host("aten::mm", 0.0, 100.0)
    t.gpu(GEMM, 100.0, 400.0, launch_at=92.0)  # on an idle device: starts as launched
    rep = analyse([t.write(tmp_path / "t.json")])
    (r,) = rep.ranks
    (s,) = r.steps
    assert s["time_s"] == pytest.approx(500e-6) and s["compute_s"] == pytest.approx(400e-6)
    assert rep.lineup == {}
    assert "one rank given" in render(rep)


def test_two_files_of_the_same_rank_and_missing_paths_are_refused(tmp_path: Path) -> None:
    a = training_trace(rank=0, steps=1).write(tmp_path / "a.json")
    b = training_trace(rank=0, steps=1).write(tmp_path / "b.json")
    out = _stepwatch(str(a), str(b))
    assert out.returncode == 2 and "both rank 0" in out.stderr
    out = _stepwatch(str(tmp_path / "nope.json"))
    assert out.returncode == 2 and "no such file" in out.stderr
    (tmp_path / "bad.json").write_text("[1, 2]")
    out = _stepwatch(str(tmp_path / "bad.json"))
    assert out.returncode == 2 and "JSON object" in out.stderr


def test_a_missing_rank_leaves_its_groups_collectives_unmatched(tmp_path: Path) -> None:
    """Groups that list their members (newer traces) need every member to line up."""
    for rank in (0, 1):
        training_trace(rank=rank, world=3, steps=2).write(tmp_path / f"r{rank}.json")
    rep = analyse([tmp_path])
    assert rep.lineup == {} and rep.unmatched == 4
    assert "no collective could be lined up" in render(rep)
