"""One event per rank and cause when two detectors flag the same problem.

With the profiler on, the per-window detector (profiler breakdown: long compute, short
wait) and the always-on late-arrival detector (last at the all-reduce on most steps, with
extra training-thread CPU) both flag a rank doing more work, each from its own first
step. The worker keeps one event for ``straggler:compute:rank=2``: opened by whichever
detector came first, the other's evidence added under its name, open while either holds
it, closed when both let go. Real database (SQLite and PostgreSQL), batches through the
real API in process, worker passes run by the test.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from stepwatch_server.app import create_app
from stepwatch_server.settings import Settings
from stepwatch_server.storage.backend import open_storage
from stepwatch_server.worker import AnalysisWorker, WorkerConfig

from ..payloads import payload, profile_entry

W = 4  # ranks
STEPS = 8  # steps per window (window_seconds 4 / 0.5 s steps)
SLOW = 2
KEY = f"straggler:compute:rank={SLOW}"


@pytest.fixture
def client(db_url: str, engine: Engine) -> Iterator[TestClient]:
    app = create_app(Settings(database_url=db_url, window_seconds=4.0, analysis_enabled=False), engine=engine)
    with TestClient(app) as c:
        yield c


def _batch(rank: int, window: int, slow: bool) -> dict[str, Any]:
    """One rank's window: the profiler covered every step; when ``slow``, rank 2 computes
    0.1 s more per step, enters the all-reduce 0.1 s after its peers (its sync is the short
    one) and burns 0.1 s more CPU."""
    late = slow and rank == SLOW
    first = window * STEPS + 1
    starts = [(first - 1 + j) * 0.5 for j in range(STEPS)]
    jitter = [0.0005 * ((rank * 3 + j + window) % 4) for j in range(STEPS)]
    enter = [t + (0.45 if late else 0.35) + dj for t, dj in zip(starts, jitter, strict=True)]
    end = [t + 0.47 for t in starts]
    comm = {
        "version": 1,
        "arrive_s": [0.4] * STEPS,
        "end_s": [0.45] * STEPS,
        "sync_s": [(0.02 if late else 0.12) + dj for dj in jitter],
        "cpu_s": [0.3 + dj + (0.1 if late else 0.0) for dj in jitter],
    }
    prof = profile_entry(
        first_step=first, enter=enter, end=end, compute=0.4 if late else 0.3, overlapped=0.02, exposed=0.02
    )
    return payload(
        rank=rank,
        world=W,
        first=first,
        times=[0.5] * STEPS,
        waits=[0.001] * STEPS,
        comm=comm,
        profiles=[prof],
    )


def send(client: TestClient, windows: range, *, slow: range) -> None:
    for w in windows:
        for r in range(W):
            r_ = client.post("/api/v1/ingest", json=_batch(r, w, w in slow))
            assert r_.status_code == 200, r_.text


def worker(engine: Engine) -> AnalysisWorker:
    return AnalysisWorker(open_storage(engine), WorkerConfig(), clock=time.time)


def stragglers(client: TestClient) -> list[dict[str, Any]]:
    evs = client.get("/api/v1/runs/test-run/events", params={"kind": "straggler"}).json()
    return [e for e in evs if e["ranks"] == [SLOW]]


def test_both_detectors_flag_rank_2_and_one_event_holds_both(client: TestClient, engine: Engine) -> None:
    slow = range(2, 8)
    send(client, range(0, 7), slow=slow)
    report = worker(engine).run_once()
    assert report.windows == 6  # window 6 holds the newest steps: not complete yet
    (ev,) = stragglers(client)
    assert (ev["key"], ev["cause"], ev["status"]) == (KEY, "compute", "open")
    # Both detectors saw it: the late-arrival one opened first (2 windows), the window
    # detector's evidence (3 windows) joined the same event under its name.
    assert ev["evidence"].get("detectors") == 2.0, (ev, report.transitions)
    assert ev["evidence"]["extra_cpu_s"] == pytest.approx(0.1, abs=0.01)  # the arrival detector's
    assert ev["evidence"]["window.compute_s"] == pytest.approx(0.4)  # the window detector's
    assert ev["evidence"]["opened_window"] == 3
    assert ev["first_step"] == 2 * STEPS + 1
    assert "Also found by the window detector" in ev["message"]
    opened = [t.finding.key for _, t in report.transitions]
    assert opened.count(KEY) == 1  # one webhook notification, not two

    # The fault ends; each detector lets go after its own hysteresis; one event closes.
    send(client, range(7, 16), slow=slow)
    later = worker(engine).run_once()
    (ev,) = stragglers(client)
    assert ev["status"] == "closed" and ev["first_step"] == 2 * STEPS + 1
    assert [t.finding.status for _, t in later.transitions if t.finding.key == KEY] == ["closed"]
    assert worker(engine).run_once().transitions == []  # a replayed pass changes nothing
