"""``stepwatch top`` against a real collector over loopback, as a real process: the
frames show the runs, the run's numbers, every rank and the events; a dead collector or
an unknown run gives one line that says what to do, and exit status 2."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from stepwatch.demo.launch import free_port
from stepwatch_server.storage import migrate

from ..events import insert_event
from ..live import serve_in_thread
from ..payloads import payload

RUN, RANKS = "top-run", 4


def _top(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "160"}
    return subprocess.run(
        [sys.executable, "-m", "stepwatch", "top", *args], capture_output=True, text=True, timeout=60, env=env
    )


@pytest.fixture
def fed_collector(tmp_path: Path) -> Iterator[str]:
    db = f"sqlite:///{tmp_path / 'top.db'}"
    migrate.upgrade(db)
    with serve_in_thread(db) as url:
        with httpx.Client(base_url=url, timeout=10) as c:
            for first in (1, 9):
                for rank in range(RANKS):
                    waits = [0.3 if rank == 1 else 0.01] * 8  # rank 1's loader stalls
                    body = payload(run=RUN, rank=rank, world=RANKS, first=first, times=[0.5] * 8, waits=waits)
                    c.post("/api/v1/ingest", json=body).raise_for_status()
        insert_event(db, RUN, first_step=3, last_step=16, ranks=[1], cause="data", status="open")
        yield url


def test_top_shows_runs_ranks_and_events_for_a_few_refreshes(fed_collector: str) -> None:
    r = _top("--url", fed_collector, "--iterations", "2", "--interval", "0.2")
    assert r.returncode == 0, r.stdout + r.stderr
    frames = r.stdout.split("stepwatch top ")[1:]
    assert len(frames) == 2, r.stdout
    for frame in frames:
        assert fed_collector in frame
        assert RUN in frame and f"{RANKS}/{RANKS} ranks" in frame and "step 16" in frame
        assert "MFU" in frame and "explicit/bf16/test-device@100TFLOPs[user]" in frame
        assert "no profiler data yet" in frame, "the breakdown's absence is said, not shown as zeros"
        rows = [line for line in frame.splitlines() if "node0" in line and not line.startswith("│")]
        assert len(rows) == RANKS, frame
        assert rows[1].strip().startswith("⚠ 1") and all(
            "⚠" not in row for i, row in enumerate(rows) if i != 1
        )
        assert "[live]" in frame and "│ top-run │   live │" in frame
        assert "straggler/data" in frame and "rank 1 is a data straggler from step 3" in frame


def test_top_names_the_run_it_was_asked_for_or_says_which_exist(fed_collector: str) -> None:
    r = _top("--url", fed_collector, "--iterations", "1", "--run", "nope")
    assert r.returncode == 2
    assert "run 'nope' is not on" in r.stdout and RUN in r.stdout


def test_top_says_what_to_do_when_no_collector_answers() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    r = _top("--url", url, "--iterations", "1")
    assert r.returncode == 2
    out = " ".join(r.stdout.split())
    assert f"no collector answers at {url}" in out and "stepwatch serve" in out and "--url" in out
    assert "Traceback" not in r.stdout + r.stderr
