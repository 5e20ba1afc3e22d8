"""The agent's sender against a real collector over loopback HTTP."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

import stepwatch
from stepwatch._env import detect
from stepwatch._sender import Sender
from stepwatch.config import AgentConfig
from stepwatch.demo.launch import free_port

from ..live import LoopbackServer, SlowServer, serve_in_thread
from ..wait import wait_until


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
    # Nothing listens yet: the sender tries (a condition, not a fixed wait: on loaded cores
    # its first attempt came after the 0.3 s this test once gave it), sends nothing, and
    # training goes on; a flush is not done.
    wait_until(lambda: sw.stats["failed_attempts"] >= 1, "the sender's first failed attempt")
    assert sw.stats["sent_batches"] == 0 and not sw.flush(timeout_s=0.05)
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


class _Clock:
    """A monotonic clock the test moves: the sender's rate limit and deadline read it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _sender_agent(
    url: str, *, run: str = "sender-test", token: str | None = None, clock: _Clock | None = None, **kw: Any
) -> stepwatch.Stepwatch:
    cfg = AgentConfig(run=run, url=url, max_window_steps=10, send_interval_s=1e9, warmup_steps=0)
    holder: dict[str, stepwatch.Stepwatch] = {}
    sender = Sender(
        url,
        lambda w, s: holder["sw"]._encode(w, s),
        token=token,
        backoff_base_s=0.01,
        backoff_max_s=0.05,
        poll_s=0.05,
        label="rank 0",
        clock=clock or time.monotonic,
        **kw,
    )
    sw = holder["sw"] = stepwatch.Stepwatch(cfg, detect({}, host="h"), convention=None, sender=sender)
    return sw


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "stepwatch" and r.levelno >= logging.WARNING]


def _until(condition: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_unreachable_collector_is_named_early_and_once_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="stepwatch")
    url = f"http://127.0.0.1:{free_port()}"
    clock = _Clock()
    sw = _sender_agent(url, clock=clock)
    for _ in range(30):
        sw.step(tokens=1)
    _until(lambda: sw.stats["failed_attempts"] >= 20, "the sender stopped retrying")
    (first,) = _warnings(caplog)  # one line, at the first failure, however many attempts
    assert f"{url}/api/v1/ingest" in first and "Connection refused" in first, first
    assert "window(s) waiting" in first
    clock.now += 61.0  # a minute later: one reminder, with the windows still waiting
    tried = sw.stats["failed_attempts"]
    _until(lambda: sw.stats["failed_attempts"] >= tried + 20, "the sender stopped retrying")
    assert len(_warnings(caplog)) == 2 and "3 window(s) waiting" in _warnings(caplog)[1]
    sw.close(timeout_s=0.0)


def test_wrong_token_one_line_per_rank_and_the_drops_are_counted(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="stepwatch")
    with serve_in_thread(db_url, write_tokens="right-token-0123456789") as url:
        sw = _sender_agent(url, token="wrong-token-0123456789")
        for _ in range(50):  # 5 windows, each refused with 401
            sw.step(tokens=1)
        assert sw.flush(timeout_s=20), "a refused batch is dropped, not retried"
        assert (sw.stats["rejected_batches"], sw.stats["rejected_steps"]) == (5, 50)
        (line,) = _warnings(caplog)
        assert "HTTP 401: unknown bearer token" in line and f"{url}/api/v1/ingest" in line, line
        sw.close(timeout_s=1.0)


class _FailsOnFirstBatch(LoopbackServer):
    """Answers ``status`` to every attempt of the first batch it sees (a batch the collector
    cannot store) and 200 to the others."""

    def __init__(self, status: int) -> None:
        super().__init__()
        self.status = status
        self.first: str | None = None

    def respond(self, body: bytes) -> tuple[int, dict[str, str], bytes]:
        batch = json.loads(body)["batch_id"]
        self.first = self.first or batch
        if batch == self.first:
            return self.status, {"retry-after": "0"}, b'{"detail":"could not store it"}'
        return super().respond(body)


def test_a_batch_the_collector_fails_on_is_dropped_and_the_rest_go_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="stepwatch")
    with _FailsOnFirstBatch(500) as server:
        sw = _sender_agent(server.url, max_attempts=3)
        for _ in range(40):
            sw.step(tokens=1)
        assert sw.flush(timeout_s=20)
        payloads = [json.loads(b) for b in server.bodies]
    first = [p for p in payloads if p["batch_id"] == server.first]
    later = [p for p in payloads if p["batch_id"] != server.first]
    assert len(first) == 3, "dropped after max_attempts"
    assert [p["steps"]["first"] for p in later] == [11, 21, 31], "the windows behind it went on"
    assert [p["agent"]["dropped_windows"] for p in later] == [1, 1, 1]
    assert [p["agent"]["dropped_steps"] for p in later] == [10, 10, 10]
    drops = [w for w in _warnings(caplog) if "dropped a batch" in w]
    assert len(drops) == 1 and "3 attempts failed" in drops[0] and "HTTP 500: could not store it" in drops[0]
    sw.close(timeout_s=1.0)


def test_a_collector_that_is_away_is_waited_for_beyond_max_attempts() -> None:
    class AwayAWhile(LoopbackServer):
        def respond(self, body: bytes) -> tuple[int, dict[str, str], bytes]:
            if self.received <= 8:  # the database is away: 503 with Retry-After
                return 503, {"retry-after": "0"}, b'{"detail":"database unavailable; retry later"}'
            return super().respond(body)

    with AwayAWhile() as server:
        sw = _sender_agent(server.url, max_attempts=3)
        for _ in range(10):
            sw.step(tokens=1)
        assert sw.flush(timeout_s=20)
        assert server.received == 9 and sw.stats["rejected_batches"] == 0 and sw.stats["sent_steps"] == 10
        sw.close(timeout_s=1.0)


def test_close_returns_at_its_deadline_leaving_a_hung_request(caplog: pytest.LogCaptureFixture) -> None:
    """The deadline is read from the sender's clock, which the test moves: the real request
    hangs for minutes, and close() returns once the clock passes the deadline (no join margin,
    no waiting for the request's own timeout)."""
    caplog.set_level(logging.WARNING, logger="stepwatch")
    clock = _Clock()
    with SlowServer(delay_s=300.0) as hole:
        sw = _sender_agent(hole.url, clock=clock, timeout_s=300.0)
        for _ in range(10):
            sw.step(tokens=1)
        _until(lambda: hole.received == 1, "the sender never posted")
        result: list[bool] = []
        closer = threading.Thread(target=lambda: result.append(sw.close(timeout_s=120.0)))
        closer.start()
        _until(lambda: sw._sender._deadline is not None, "close() never set its deadline")
        clock.now += 120.0
        closer.join(30)  # liveness bound: a join past the deadline would wait 120 s or more
        assert not closer.is_alive() and result == [False]
        thread = sw._sender._thread
        assert thread is not None and thread.is_alive(), "the sender thread was left in its request"
        assert hole.received == 1
    (line,) = [w for w in _warnings(caplog) if "before the exit deadline" in w]
    assert "2 window(s) not sent" in line, "the one in flight and the final one"
    assert "no answer within 120.0 s to the request in flight" in line, line


def test_a_flapping_collector_warns_once_a_minute_not_once_a_flap(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="stepwatch")

    class Flapping(LoopbackServer):
        def respond(self, body: bytes) -> tuple[int, dict[str, str], bytes]:
            if self.received % 2:  # every other attempt: busy
                return 503, {"retry-after": "0"}, b'{"detail":"database unavailable; retry later"}'
            return super().respond(body)

    with Flapping() as server:
        sw = _sender_agent(server.url)
        for _ in range(60):  # 6 windows, each answered 503 once and then 200
            sw.step(tokens=1)
        assert sw.flush(timeout_s=20)
        assert server.received == 12 and sw.stats["sent_steps"] == 60
        sw.close(timeout_s=1.0)
    lines = _warnings(caplog)
    assert sum("cannot deliver" in w for w in lines) == 1, lines
    assert sum("delivering to the collector at" in w and "again" in w for w in lines) == 1, lines


def test_a_raw_trace_queued_by_the_last_batch_is_sent_by_the_close(db_url: str) -> None:
    """A capture near the end of a run (its flag opened late on a busy host) has its raw
    trace queued by the last batch, which the close encodes: the close sends it after the
    windows, within its deadline. It dropped it, and the capture lost the one trace it
    asked for (seen in a real run: ``test_steering_real``, beside CPU burners)."""
    import gzip

    from stepwatch.profiler._window import ProfilerWindow

    with serve_in_thread(db_url) as url:
        cfg = AgentConfig(run="traced", url=url, max_window_steps=10, send_interval_s=1e9, warmup_steps=0)
        holder: dict[str, stepwatch.Stepwatch] = {}
        sender = Sender(url, lambda w, s: holder["sw"]._encode(w, s), poll_s=0.05)
        pw = ProfilerWindow(every=0, steps=1, budget=1e9, warmup_end=0)  # no periodic window
        sw = holder["sw"] = stepwatch.Stepwatch(
            cfg, detect({}, host="h"), convention=None, sender=sender, profiler=pw
        )
        for _ in range(5):  # no window closes before close(): its encoding is the first
            sw.step(tokens=1)
        pw.traces.append(("7", gzip.compress(b'{"traceEvents": []}')))  # as the profiler thread keeps it
        assert sw.close(timeout_s=10)
        # Tried (the collector answers 404: this test made no capture 7), not dropped.
        assert (sender.stats.uploads, sender.stats.failed_uploads) == (0, 1)
        assert sender.stats.sent_batches == 1
