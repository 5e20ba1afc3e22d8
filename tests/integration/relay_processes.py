"""What the processes that ``test_host_relay.py`` spawns run: a rank, a relay alone, and
another user squatting on the relay's address.

Apart from the tests so that a spawned child imports only this and the agent. A child that
imported the test module (the collector, SQLAlchemy, Starlette, the test helpers) spent
more CPU on that than on its own work: the module's 15 tests took 61 CPU-seconds, children
included, against 13 with this module (2026-12-05, ``pytest -n 2`` of the module alone).
"""

from __future__ import annotations

import json
import os
import socket
import time
from multiprocessing.synchronize import Event
from typing import Any

RUN = "relay"
STEPS = 8  # steps per window
TIMEOUT_S = 60.0


def rank_main(
    url: str,
    rank: int,
    world: int,
    windows: int,
    out: Any,
    go: Event | None = None,
    bad: bool = False,
    first: int = 1,
    fork: bool = False,
    timeout_s: float = 5.0,
) -> None:
    """One rank: ``first`` windows, then (after ``go``) the rest; reports what it sent, what
    it was answered (batch ids) and its sender's counters."""
    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    import stepwatch
    from stepwatch._env import detect
    from stepwatch._sender import Sender
    from stepwatch.config import AgentConfig

    cfg = AgentConfig(run=RUN, url=url, max_window_steps=STEPS, send_interval_s=1e9, warmup_steps=0)
    holder: dict[str, stepwatch.Stepwatch] = {}
    sent: list[str] = []
    answered: list[str] = []

    def encode(w: Any, s: Any) -> bytes:
        body = holder["sw"]._encode(w, s)
        sent.append(json.loads(body)["batch_id"])
        return body.replace(b'"host":"node-a"', b'"host":"node a"') if bad else body

    sender = Sender(
        url,
        encode,
        host_batch=True,
        timeout_s=timeout_s,
        backoff_base_s=0.05,
        backoff_max_s=0.2,
        poll_s=0.05,
        on_answer=lambda b: answered.append(json.loads(b)["batch_id"]),
    )
    info = detect({}, rank=rank, local_rank=rank, world_size=world, host="node-a")
    sw = stepwatch.Stepwatch(cfg, info, convention=None, sender=sender)
    holder["sw"] = sw
    for k in range(windows):
        if k == first and go is not None:
            child = os.fork() if fork else None  # as a DataLoader worker is forked
            if child == 0:
                time.sleep(TIMEOUT_S)
                os._exit(0)
            out.put(("ready", rank, child))
            go.wait(TIMEOUT_S)
        for _ in range(STEPS):
            sw.step(tokens=1)
        sw.flush(TIMEOUT_S)
    sw.close(TIMEOUT_S)  # its final batch too
    out.put(("done", rank, sent, answered, dict(sw.stats)))


def relay_main(url: str, out: Any, stop: Event) -> None:
    from stepwatch import _relay

    _relay.Relay.start(_relay.address(url, None), url, {}, 1.0)
    out.put("relaying")
    stop.wait(TIMEOUT_S)


def squat(addr: bytes, ready: Any, got: Any) -> None:
    """Another user (nobody) holding the relay's address: reports what it was sent."""
    os.setuid(65534)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(addr)
        sock.listen(1)
        ready.put("bound")
        conn, _ = sock.accept()
        with conn:
            conn.settimeout(TIMEOUT_S)
            got.put(conn.recv(1 << 16))
