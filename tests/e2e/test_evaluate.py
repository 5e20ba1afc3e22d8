"""``stepwatch evaluate --fast`` from a clean checkout: a real collector process, the
simulator, the analysis worker; the table printed and every goal met. (The real-time hang
scenarios run in the full evaluation; hangs are tested in test_analysis.py and
tests/integration/test_worker.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_evaluate_fast_prints_the_table_and_meets_the_goals(tmp_path: Path) -> None:
    out_json = tmp_path / "eval.json"
    r = subprocess.run(
        [sys.executable, "-m", "stepwatch", "evaluate", "--fast", "--json", str(out_json)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    for name in (
        "slow compute rank",
        "slow link",
        "loader stall",
        "slow host",
        "MFU drop 5%",
        "clean",
    ):
        assert name in r.stdout
    assert "All met." in r.stdout
    rows = json.loads(out_json.read_text())["rows"]
    paths = {(row["scenario"].split(" (")[0], row["path"]) for row in rows}
    assert ("slow compute rank", "collector") in paths and ("slow compute rank", "direct") in paths
    for row in rows:
        assert row["goal"] == row["runs"] and row["false_flags"] == 0, row
        if not row["clean"]:
            assert row["flagged"] == row["right"] == row["runs"], row
    clean_windows = sum(row["rank_windows"] for row in rows if row["clean"])
    assert clean_windows >= 10_000
