"""``stepwatch serve`` on PostgreSQL runs the analysis worker in a process of its own
(``worker/process.py``): no web worker runs it, it flags what the thread flagged, its
counters and the web workers' are summed by every scrape, it is started again when it
dies, and it dies with a SIGKILLed ``serve``. The processes are real (``serve`` with two
uvicorn workers, simulated ranks through the agent's real sender); they are found by
their parent and name in ``/proc`` (Linux, as the collector's deployment)."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import httpx

from stepwatch.demo import launch
from stepwatch.simulate import Simulation, TimingModel, Topology, parse_fault
from stepwatch_server.settings import Settings
from stepwatch_server.worker.process import PROCESS_NAME, analysis_apart

from .. import pg
from ..wait import wait_until

ENV = {"STEPWATCH_WINDOW_SECONDS": "32", "STEPWATCH_ANALYSIS_INTERVAL_S": "0.1", "STEPWATCH_WORKERS": "2"}
WINDOWS = 8


def _children(pid: int) -> dict[int, str]:
    """The live children of ``pid`` and their names (``/proc/PID/comm``)."""
    kids = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/comm") as f:
                name = f.read().strip()
        except OSError:  # gone meanwhile
            continue
        state, ppid = stat.rpartition(")")[2].split()[:2]
        if int(ppid) == pid and state != "Z":
            kids[int(entry)] = name
    return kids


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv]
    return {k.decode(): v.decode(errors="replace") for k, v in pairs}


def _analysis_pid(serve_pid: int, other_than: int = 0) -> int | None:
    """The analysis process (once it has named itself, early in its start)."""
    named = [p for p, name in _children(serve_pid).items() if name == PROCESS_NAME and p != other_than]
    assert len(named) <= 1, named
    return named[0] if named else None


def _web_workers(serve_pid: int, analysis: int) -> list[int]:
    """``serve``'s other children but multiprocessing's resource tracker."""
    kids = [p for p in _children(serve_pid) if p != analysis]
    return [p for p in kids if b"resource_tracker" not in Path(f"/proc/{p}/cmdline").read_bytes()]


def _counter(text: str, name: str) -> float:
    return float(next(x for x in text.splitlines() if x.startswith(name)).split()[-1])


def test_the_analysis_runs_apart_on_postgresql_and_in_the_web_workers_on_sqlite() -> None:
    pg_url, sqlite_url = "postgresql+psycopg://u@h/db", "sqlite:///stepwatch.db"
    assert analysis_apart(Settings(database_url=pg_url))
    assert not analysis_apart(Settings(database_url=sqlite_url))
    assert not analysis_apart(Settings(database_url=pg_url, analysis_mode="thread"))
    assert analysis_apart(Settings(database_url=sqlite_url, analysis_mode="process"))


def _gone(pid: int) -> bool:
    """Exited (a zombie too: a test in a container may run as PID 1 and reap nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True


def test_serve_analyses_in_its_own_process(pg_admin: str, tmp_path: Path) -> None:
    model = TimingModel(
        Topology(hosts=2, ranks_per_host=4),
        steps_per_window=16,
        faults=[parse_fault("compute:rank=5,at=2")],
        seed=3,
    )
    counters = tmp_path / "counters"  # the multiprocess files, here rather than in /tmp
    counters.mkdir()
    env = {**ENV, "PROMETHEUS_MULTIPROC_DIR": str(counters)}
    log_path = str(tmp_path / "collector.log")
    web: list[int] = []
    with pg.fresh_database(pg_admin) as db, launch.collector(db, log_path=log_path, env=env) as col:
        try:
            serve = col.process.pid
            analysis = wait_until(lambda: _analysis_pid(serve), "the analysis process", timeout_s=60)
            web = _web_workers(serve, analysis)
            assert len(web) == 2, _children(serve)
            # The web workers were told not to analyse (``serve`` passes settings by environment).
            assert all(_environ(p).get("STEPWATCH_ANALYSIS_ENABLED") == "false" for p in web)

            result = Simulation(model, url=col.url, run="apart", senders=2).run_windows(WINDOWS)
            assert result.rejected_batches == 0 and result.sent_batches == 8 * WINDOWS

            def analysed() -> bool:
                text = httpx.get(f"{col.url}/metrics").text  # counted once the pass is over
                return _counter(text, "stepwatch_analysis_windows_total") >= WINDOWS

            wait_until(analysed, "the analysis of every window", timeout_s=30, every_s=0.1)
            ov = httpx.get(f"{col.url}/api/v1/runs/apart").json()
            assert ov["analysis"]["analysed_through_step"] == result.last_step
            events = httpx.get(f"{col.url}/api/v1/runs/apart/events").json()
            assert [(e["key"], e["ranks"]) for e in events] == [("straggler:compute:rank=5", [5])]
            # Each scrape, whichever web worker answers it, sums every process's counters:
            # the batches both web workers stored, the windows the analysis process analysed.
            stored = 'stepwatch_ingest_batches_total{outcome="stored"}'
            for _ in range(6):
                text = httpx.get(f"{col.url}/metrics").text
                assert _counter(text, stored) == result.sent_batches
                assert _counter(text, "stepwatch_analysis_windows_total") == WINDOWS

            # A dead analysis process is started again.
            os.kill(analysis, signal.SIGKILL)
            again = wait_until(lambda: _analysis_pid(serve, analysis), "another analysis", timeout_s=60)
            # And it dies with a SIGKILLed serve (the kernel sends it SIGTERM), as do the
            # web workers (``children.py``).
            col.process.kill()
            col.process.wait()
            wait_until(lambda: _gone(again), "the analysis to exit", timeout_s=30)
            wait_until(lambda: all(_gone(p) for p in web), "the web workers to exit", timeout_s=30)
            log = col.log()
        finally:  # should a web worker outlive the SIGKILLed supervisor: ours to stop
            for p in web:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
    assert "exited with -9" in log, log


def test_a_sigtermed_serve_stops_its_analysis_and_leaves_no_counters_behind(
    pg_admin: str, tmp_path: Path
) -> None:
    """One web worker (uvicorn in ``serve``'s own process, which raises the SIGTERM again
    once it has shut down): the analysis process is stopped and the counters' directory
    removed before ``serve`` dies of the signal."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {"STEPWATCH_ANALYSIS_INTERVAL_S": "0.1", "TMPDIR": str(tmp)}
    log_path = str(tmp_path / "collector.log")
    with pg.fresh_database(pg_admin) as db, launch.collector(db, log_path=log_path, env=env) as col:
        analysis = wait_until(lambda: _analysis_pid(col.process.pid), "the analysis process", timeout_s=60)
        (made,) = tmp.iterdir()
        assert made.name.startswith("stepwatch-metrics-")
        col.process.terminate()
        assert col.process.wait(30) == -signal.SIGTERM
        wait_until(lambda: _gone(analysis), "the analysis to exit", timeout_s=30)
    assert list(tmp.iterdir()) == []
