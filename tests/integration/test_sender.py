"""The agent's sender against a real collector over loopback HTTP."""

from __future__ import annotations

import httpx
import pytest

import stepwatch
from stepwatch._env import detect
from stepwatch._sender import Sender
from stepwatch.config import AgentConfig
from stepwatch.demo.launch import free_port

from ..live import serve_in_thread


def _agent(url: str, *, run: str = "sender-test", backoff_s: float = 0.05) -> stepwatch.Stepwatch:
    cfg = AgentConfig(run=run, url=url, max_window_steps=10, send_interval_s=1e9, warmup_steps=0)
    holder: dict[str, stepwatch.Stepwatch] = {}
    sender = Sender(
        url, lambda w, s: holder["sw"]._encode(w, s), backoff_base_s=backoff_s, backoff_max_s=0.2, poll_s=0.05
    )
    sw = stepwatch.Stepwatch(cfg, detect({}, host="h"), convention=None, sender=sender)
    holder["sw"] = sw
    return sw


def test_every_window_arrives_once(db_url: str) -> None:
    with serve_in_thread(db_url) as url:
        sw = _agent(url)
        for _ in range(35):
            sw.step(tokens=10)
        assert sw.flush(timeout_s=20)
        stats = sw.stats
        assert (stats["sent_batches"], stats["sent_steps"], stats["dropped_windows"]) == (4, 35, 0)
        ov = httpx.get(f"{url}/api/v1/runs/sender-test").json()
        assert (ov["steps_stored"], ov["tokens_total"]) == (35, 350)
        sw.close()


def test_collector_down_at_start_then_up_loses_nothing(db_url: str) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    sw = _agent(url)
    for _ in range(30):
        sw.step(tokens=1)
    assert not sw.flush(timeout_s=0.3)  # nothing listens yet: not flushed, but no error
    assert sw.stats["failed_attempts"] >= 1 and sw.stats["sent_batches"] == 0
    with serve_in_thread(db_url, port=port):
        assert sw.flush(timeout_s=20)
        assert sw.stats["sent_steps"] == 30
        ov = httpx.get(f"{url}/api/v1/runs/sender-test").json()
        assert ov["steps_stored"] == 30
        sw.close()


def test_buffer_is_bounded_and_drops_are_counted_and_reported(db_url: str) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cfg = AgentConfig(run="bounded", url=url, max_window_steps=5, send_interval_s=1e9, warmup_steps=0)
    holder: dict[str, stepwatch.Stepwatch] = {}
    sender = Sender(
        url,
        lambda w, s: holder["sw"]._encode(w, s),
        max_windows=3,
        backoff_base_s=0.05,
        backoff_max_s=0.1,
        poll_s=0.05,
    )
    sw = holder["sw"] = stepwatch.Stepwatch(cfg, detect({}, host="h"), convention=None, sender=sender)
    for _ in range(100):  # 20 windows into a queue of 3 (+1 in flight) while nothing listens
        sw.step(tokens=1)
    assert sender.pending() <= 4
    dropped = sw.stats["dropped_windows"]
    assert dropped >= 16
    with serve_in_thread(db_url, port=port):
        assert sw.flush(timeout_s=20)
        ranks = httpx.get(f"{url}/api/v1/runs/bounded/ranks").json()
        assert ranks[0]["dropped_windows"] == dropped
        assert ranks[0]["dropped_steps"] == 5 * dropped
        sw.close()


@pytest.mark.parametrize("status", [422])
def test_rejected_batch_is_not_retried_forever(db_url: str, status: int) -> None:
    with serve_in_thread(db_url) as url:
        sw = _agent(url, run="bad name")  # the collector rejects this run name (422)
        sw.step(tokens=1)
        assert sw.flush(timeout_s=10)
        assert sw.stats["rejected_batches"] == 1
        assert str(status) in (sw.stats["last_error"] or "")
        sw.close()
