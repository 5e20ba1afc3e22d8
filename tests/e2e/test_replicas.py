"""Two collector processes on one PostgreSQL give the same flags as one (DESIGN §9).

The simulator's senders alternate between the two collectors (a load balancer's view);
both run their analysis worker. The per-run advisory lock and the state's version make
them take turns: every window is analysed exactly once, and the events equal those of a
single collector fed the same seeded run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from stepwatch.demo import launch
from stepwatch.simulate import Simulation, TimingModel, Topology, parse_fault
from stepwatch_server.storage import migrate

from .. import pg
from ..wait import wait_until

ENV = {"STEPWATCH_WINDOW_SECONDS": "32", "STEPWATCH_ANALYSIS_INTERVAL_S": "0.1"}
WINDOWS = 12


def _model() -> TimingModel:
    faults = [parse_fault("compute:rank=5,at=2"), parse_fault("data:rank=12,at=3,until=7")]
    return TimingModel(Topology(hosts=4, ranks_per_host=4), steps_per_window=16, faults=faults, seed=7)


def _analysed(url: str, run: str, last_step: int, timeout_s: float = 30) -> None:
    def through() -> bool:
        ov = httpx.get(f"{url}/api/v1/runs/{run}").json()
        return bool((ov.get("analysis") or {}).get("analysed_through_step", 0) >= last_step)

    wait_until(through, f"{url}: analysis to reach step {last_step}", timeout_s=timeout_s, every_s=0.1)


def _flags(url: str, run: str) -> set[tuple[Any, ...]]:
    events = httpx.get(f"{url}/api/v1/runs/{run}/events").json()
    return {
        (
            e["key"],
            e["first_step"],
            e["last_step"],
            e["status"],
            e["cause"],
            tuple(e["ranks"]),
            e["evidence"]["opened_window"],
        )
        for e in events
    }


def _windows_analysed(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return float(
        next(x for x in text.splitlines() if x.startswith("stepwatch_analysis_windows_total")).split()[-1]
    )


def test_two_collectors_give_the_same_flags_as_one(pg_admin: str, tmp_path: Path) -> None:
    with pg.fresh_database(pg_admin) as one_db, pg.fresh_database(pg_admin) as two_db:
        migrate.upgrade(two_db)  # once, before two processes start on it
        with launch.collector(one_db, log_path=str(tmp_path / "one.log"), env=ENV) as one:
            result = Simulation(_model(), url=one.url, run="rep", senders=4).run_windows(WINDOWS)
            _analysed(one.url, "rep", result.last_step)
            single = _flags(one.url, "rep")
        with (
            launch.collector(two_db, log_path=str(tmp_path / "a.log"), env=ENV) as a,
            launch.collector(two_db, log_path=str(tmp_path / "b.log"), env=ENV) as b,
        ):
            both = Simulation(_model(), url=a.url, replicas=[b.url], run="rep", senders=4).run_windows(
                WINDOWS
            )
            assert both.rejected_batches == 0 and both.sent_batches == both.batches == 16 * WINDOWS
            _analysed(a.url, "rep", both.last_step)
            from_a, from_b = _flags(a.url, "rep"), _flags(b.url, "rep")
            analysed = _windows_analysed(a.url) + _windows_analysed(b.url)
            logs = a.log() + b.log()
    assert {f[0] for f in single} == {"straggler:compute:rank=5", "straggler:data:rank=12"}
    assert from_a == from_b == single
    assert analysed == WINDOWS  # each window exactly once, whichever replica took it
    assert "failed" not in logs, logs
