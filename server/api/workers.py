"""The web worker processes of ``stepwatch serve --workers N`` on Linux: each listens on
its own socket bound to the collector's port with ``SO_REUSEPORT``, so that the kernel
deals new connections among them by a hash of each connection's addresses.

uvicorn's workers share one listening socket, and whichever worker is in its accept
loop when connections arrive takes them, as many as are queued. Agents keep their
connection open (keep-alive) for the whole run, and a job's ranks connect at about the
same moment, so one burst of connections decided the split for good: measured on the
ingest benchmark's 128 connections to 2 workers, 63/65, 57/71 and 102/26 in three
phases. A worker's requests run under its own GIL, so the worker holding four fifths of
the connections capped the collector at a little more than one core's worth of ingest.
Dealt by hash, a burst splits as evenly as the addresses do.

Elsewhere (``SO_REUSEPORT`` does not balance on macOS, is absent on Windows) and with one
worker, uvicorn serves as before (``cli.run_uvicorn``).

The supervisor is this process: it holds the port (bound, not listening, so it takes no
connection), starts the workers (``spawn``: each imports the app afresh, as uvicorn's
workers do), passes SIGINT and SIGTERM on to them (each shuts down gracefully), restarts
a worker that died while the collector runs (not one that exited with an error as it
started: that one could not start), and returns once every worker has exited.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from types import FrameType

log = logging.getLogger("stepwatch_server")
#: A worker that exits with an error sooner than this after its start failed to start
#: (its app or its socket), and is not started again; one killed by a signal always is.
STARTUP_S = 10.0


def balanced() -> bool:
    """Whether this platform deals connections among ``SO_REUSEPORT`` sockets (Linux)."""
    return sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` that other sockets of this user may bind too
    (``SO_REUSEPORT``); the kernel spreads connections over those that listen."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def serve(workers: int, host: str, port: int, target: Callable[[str, int], None]) -> int | None:
    """Run ``target(host, port)`` in ``workers`` processes, each binding its own socket,
    until they exit; a worker that dies unasked is started again. Returns the signal that
    stopped them (SIGINT or SIGTERM), None if they exited by themselves."""
    try:
        held = listening_socket(host, port)  # the port, also when 0 asked for any free one
    except OSError as exc:  # as uvicorn says it, and exits
        log.error("could not bind %s:%d: %s", host, port, exc.strerror or exc)
        raise SystemExit(1) from None
    port = held.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    stopped: list[int] = []

    def start() -> BaseProcess:
        p = ctx.Process(target=target, args=(host, port), name="stepwatch-web")
        p.start()
        return p

    def stop(signum: int, _frame: FrameType | None) -> None:
        stopped.append(signum)
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                os.kill(p.pid, signal.SIGTERM)

    procs = [start() for _ in range(workers)]
    started = [time.monotonic()] * workers
    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while any(p.exitcode is None for p in procs):
            wait([p.sentinel for p in procs if p.exitcode is None])
            for i, p in enumerate(procs):
                if p.exitcode is None or stopped:
                    continue
                p.join()
                # Failed as it started (its app, its socket): another would fail alike.
                if p.exitcode > 0 and time.monotonic() - started[i] < STARTUP_S:
                    stop(signal.SIGTERM, None)
                    stopped[0] = 0
                    log.error("web worker %d exited with %s as it started", p.pid, p.exitcode)
                    break
                log.warning("web worker %d exited with %s; starting another", p.pid, p.exitcode)
                procs[i], started[i] = start(), time.monotonic()
        for p in procs:
            p.join()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        held.close()
    if stopped and stopped[0] == 0:
        raise RuntimeError("a web worker exited as it started (its log says why)")
    return stopped[0] if stopped else None
