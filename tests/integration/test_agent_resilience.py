"""The agent never hurts training, whatever the collector does.

Collector dead at start (``test_sender.py``), killed mid-run, or up but answering only
after 10 s; a long outage with many windows; exit with a dead collector; DataLoader
workers forked while the sender runs; ``init`` called again. Step-time cost on real gloo
training is measured by ``benchmarks/agent_overhead.py``, not here: these tests assert
behaviour (nothing blocks, nothing is lost or sent twice, memory stays bounded).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import httpx
import pytest

import stepwatch
from stepwatch._env import detect
from stepwatch._sender import Sender
from stepwatch.config import AgentConfig
from stepwatch.demo.launch import free_port

from ..live import CollectorProcess, SlowServer, serve_in_thread
from ..wait import wait_until


def _agent(url: str, run: str, *, window: int = 10, max_windows: int = 256) -> stepwatch.Stepwatch:
    cfg = AgentConfig(run=run, url=url, max_window_steps=window, send_interval_s=1e9, warmup_steps=0)
    holder: dict[str, stepwatch.Stepwatch] = {}
    sender = Sender(
        url,
        lambda w, s: holder["sw"]._encode(w, s),
        max_windows=max_windows,
        timeout_s=5.0,
        backoff_base_s=0.05,
        backoff_max_s=0.2,
        poll_s=0.05,
    )
    holder["sw"] = stepwatch.Stepwatch(cfg, detect({}, host="h"), convention=None, sender=sender)
    return holder["sw"]


def test_collector_killed_mid_run_then_back_loses_nothing(sqlite_db: str, tmp_path: Path) -> None:
    collector = CollectorProcess(sqlite_db, str(tmp_path / "c.log"))
    collector.start()
    try:
        sw = _agent(collector.url, "killed-mid-run")
        for _ in range(40):
            sw.step(tokens=7)
        assert sw.flush(timeout_s=20)
        collector.kill()
        for _ in range(60):  # six windows while nothing listens
            sw.step(tokens=7)
        assert not sw.flush(timeout_s=0.3)
        assert sw.stats["failed_attempts"] >= 1 and sw.stats["rejected_batches"] == 0
        collector.start()
        assert sw.flush(timeout_s=20)
        ov = httpx.get(f"{collector.url}/api/v1/runs/killed-mid-run", timeout=10).json()
        sw.close()
    finally:
        collector.stop()
    assert (ov["steps_stored"], ov["tokens_total"]) == (100, 700)
    assert sw.stats["sent_steps"] == 100 and sw.stats["dropped_windows"] == 0


def test_slow_collector_never_blocks_the_training_thread() -> None:
    with SlowServer(delay_s=600.0) as slow:
        sw = _agent(slow.url, "slow", window=10)
        sw.step(tokens=1)
        for _ in range(9):
            sw.step(tokens=1)  # window 1 closes: the sender posts it and waits for the answer
        wait_until(lambda: slow.received >= 1, "the sender to post", timeout_s=10, every_s=0.01)
        # The sender thread is stuck inside a POST; the loop goes on and closes windows.
        for _ in range(500):
            sw.step(tokens=1)
        assert slow.received == 1 and sw.stats["sent_batches"] == 0
        assert sw.stats["steps"] == 510 and sw._sender.pending() == 51
        assert not sw.close(timeout_s=0.5)  # the deadline holds even with a request in flight
        thread = sw._sender._thread
        assert thread is not None and thread.is_alive(), "the hung request was left, not waited for"
        assert slow.received == 1


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _queue_bytes(sender: Sender) -> int:
    """Bytes held by the queued windows: each Window object, its dict and its arrays."""
    total = 0
    for w in list(sender._queue):
        total += sys.getsizeof(w) + sys.getsizeof(w.__dict__)
        total += sum(
            sys.getsizeof(a) for a in (w.step_time_s, w.data_wait_s, w.tokens, w.padded_tokens, w.tags)
        )
    return total


def test_long_outage_memory_stays_bounded_and_drops_are_counted() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: hours of windows in seconds
    cfg = AgentConfig(run="outage", url=url, send_interval_s=1e9, warmup_steps=0)
    sw = stepwatch.Stepwatch(cfg, detect({}, host="h"), convention=None)
    max_windows = sw._sender._max_windows
    windows = max_windows * 2
    rss0 = _rss_bytes()
    for _ in range(windows * cfg.max_window_steps):
        sw.step(tokens=4096, padded_tokens=4096)
    rss_growth = _rss_bytes() - rss0
    held = _queue_bytes(sw._sender)
    stats = sw.stats
    sw.close(timeout_s=0.1)
    mib = 1024 * 1024
    assert cfg.max_buffer_bytes * 0.9 <= held <= cfg.max_buffer_bytes * 1.1, f"{held / mib:.1f} MiB queued"
    assert rss_growth <= 64 * mib, f"RSS grew {rss_growth / mib:.1f} MiB"
    assert stats["pending_windows"] <= max_windows + 1
    assert stats["dropped_windows"] >= windows - max_windows - 1
    assert stats["dropped_steps"] == stats["dropped_windows"] * cfg.max_window_steps


EXIT_SCRIPT = """
import sys, time, stepwatch
sw = stepwatch.init(run="exit-test", url=sys.argv[1], flush_timeout_s=float(sys.argv[2]),
                    send_interval_s=0.05, rank=0, world_size=1, host="h")
for _ in range(300):
    sw.step(tokens=1)
    time.sleep(0.001)
print("done", flush=True)
"""


@pytest.mark.parametrize(
    ("collector", "reason"),
    [("dead", "Connection refused"), ("black-holed", "no answer within"), ("misnamed", "ConnectError")],
)
def test_exit_says_what_it_left_behind_and_why(collector: str, reason: str, tmp_path: Path) -> None:
    """The process ends by itself (no wall time asserted: the deadline itself is tested on
    ``Sender.close`` with an injected clock) and its last words name the URL and the reason."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(EXIT_SCRIPT))
    with SlowServer(delay_s=120.0) as hole:
        url = {
            "dead": f"http://127.0.0.1:{free_port()}",
            "black-holed": hole.url,
            "misnamed": "http://stepwatch-collector.invalid:8321",
        }[collector]
        proc = subprocess.Popen(
            [sys.executable, str(script), url, "1.0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        out, err = proc.communicate(timeout=60)  # liveness bound, far beyond the 120 s hold
    stderr = err.decode()
    assert proc.returncode == 0 and out.strip() == b"done", stderr
    (last,) = [line for line in stderr.splitlines() if "before the exit deadline" in line]
    assert f"{url}/api/v1/ingest" in last and reason in last, last


def test_forked_dataloader_workers_while_the_sender_runs(sqlite_db: str) -> None:
    import torch
    from torch.utils.data import DataLoader, Dataset

    class Numbers(Dataset[int]):
        def __len__(self) -> int:
            return 400

        def __getitem__(self, i: int) -> int:
            return i

    with serve_in_thread(sqlite_db) as url:
        sw = _agent(url, "forked", window=10)
        for _ in range(25):  # windows queued and in flight while the workers fork
            sw.step(tokens=1)
        loader = DataLoader(Numbers(), batch_size=4, num_workers=2, multiprocessing_context="fork")
        seen = 0
        for batch in sw.loader(loader):
            seen += int(torch.as_tensor(batch).numel())
            sw.step(tokens=1)
        assert sw.flush(timeout_s=20)
        ov = httpx.get(f"{url}/api/v1/runs/forked", timeout=10).json()
        reporting = httpx.get(
            f"{url}/api/v1/runs/forked/series", params={"metric": "ranks_reporting", "max_points": 1}
        ).json()
        sw.close()
    assert seen == 400
    assert ov["steps_stored"] == 125 and ov["tokens_total"] == 125
    (point,) = reporting["points"]
    assert point["max"] == 1, "no window was sent twice (by a forked worker)"


def test_fork_child_starts_with_an_empty_queue_and_its_own_thread(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    sw = _agent(url, "fork-child", window=10)
    for _ in range(30):
        sw.step(tokens=1)
    assert sw._sender.pending() >= 2
    code = tmp_path / "rc"
    pid = os.fork()
    if pid == 0:  # child: inherits the memory, not the parent's windows or thread
        ok = sw._sender.pending() == 0
        for _ in range(10):
            sw.step(tokens=1)
        ok = ok and sw._sender._thread is not None and sw._sender._thread.is_alive()
        sw.close(timeout_s=0.2)
        code.write_text("ok" if ok else "bad")
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert status == 0 and code.read_text() == "ok"
    assert sw._sender.pending() >= 2, "the parent keeps its own windows"
    sw.close(timeout_s=0.1)


def test_repeated_init_closes_the_previous_agent(sqlite_db: str) -> None:
    with serve_in_thread(sqlite_db) as url:
        for i in range(3):
            sw = stepwatch.init(run=f"again-{i}", url=url, rank=0, world_size=1, host="h", warmup_steps=0)
            for _ in range(5):
                sw.step(tokens=2)
            assert sw.flush(timeout_s=10)
            senders = [t for t in threading.enumerate() if t.name == "stepwatch-sender" and t.is_alive()]
            assert len(senders) == 1, "an old agent's sender is still running"
        assert sw.close()
        runs = {r["name"]: r["last_step"] for r in httpx.get(f"{url}/api/v1/runs", timeout=10).json()}
    assert runs == {"again-0": 5, "again-1": 5, "again-2": 5}, "each init's steps were flushed"
    assert stepwatch.current() is sw


@pytest.fixture
def sqlite_db(tmp_path: Path) -> str:
    from stepwatch_server.storage import migrate

    url = f"sqlite:///{tmp_path / 'agent.db'}"
    migrate.upgrade(url)
    return url
