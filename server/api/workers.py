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
connection: :func:`hold_port`), starts the workers (``spawn``: each imports the app
afresh, as uvicorn's workers do), passes SIGINT and SIGTERM on to them (each shuts down
gracefully; SIGHUP starts them all again, as uvicorn's supervisor does), starts again a
worker that died while the collector runs (see STARTUP_S for one that fails as it
starts), and returns once every worker has exited. Each worker names itself ``sw-web``
and dies with a SIGKILLed supervisor (``children.py``; uvicorn's outlived it).

A worker whose event loop stops turning is killed and started again: each stamps a
:class:`Beat` in shared memory from its loop (``cli._web_worker``: uvicorn's tick, ten
times a second once it serves), and one silent for longer than ``worker_timeout_s``
(the setting ``STEPWATCH_WORKER_TIMEOUT_S``) is SIGKILLed. With a socket each, a hung worker
matters more than with a shared one: the kernel goes on dealing it its share of new
connections, which no one would ever answer. uvicorn's supervisor pings a thread of the
worker, which answers while the loop is stuck; the stamp comes from the loop itself.
A worker asked to stop (SIGTERM, SIGHUP's restart) stops ticking as it drains, so it is
given ``worker_timeout_s`` from the signal instead, then killed: a frozen one would keep
its socket (and its share of connections) for ever, and ``serve`` would never return.
A worker not yet serving is not judged: its socket does not listen before its first
tick, so the kernel deals it nothing. Nor is any worker judged right after the
supervisor itself ran late (the whole collector paused and resumed, a starved machine):
silence is counted from then, not from before the pause.
"""

from __future__ import annotations

import contextlib
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
from typing import Protocol

log = logging.getLogger("stepwatch_server")
#: A worker that exits with an error sooner than this after its start failed to start
#: (its app or its socket). Before any worker ran this long, that stops ``serve`` (the
#: configuration is wrong); later it is started again after a pause that doubles, up to
#: MAX_BACKOFF_S, while its successors fail alike (a database away at their start).
STARTUP_S = 10.0
MAX_BACKOFF_S = 30.0
#: Longest wait of the supervisor: how often it reads the workers' beats, and how late a
#: worker waiting to be started again may be (a signal interrupts a wait only for its
#: handler to run, then the wait resumes).
POLL_S = 0.5
#: A supervisor wait that returned this much later than POLL_S: it did not run meanwhile
#: (the collector paused, the machine starved), so neither did its workers.
LATE_S = 5.0


class Beat(Protocol):
    """A worker's last turn of its event loop (``time.monotonic()``, the same clock in
    every process; 0 until it serves), in memory shared with the supervisor."""

    value: float


Target = Callable[[str, int, Beat], None]


def balanced() -> bool:
    """Whether this platform deals connections among ``SO_REUSEPORT`` sockets (Linux)."""
    return sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")


def _socket(host: str, *, reuse_addr: bool, reuse_port: bool) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    if reuse_addr:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    return sock


def listening_socket(host: str, port: int) -> socket.socket:
    """A worker's socket, bound to ``host:port`` beside the other workers' (``SO_REUSEPORT``,
    the same user's only); the kernel spreads connections over those that listen."""
    sock = _socket(host, reuse_addr=True, reuse_port=True)
    sock.bind((host, port))
    return sock


def hold_port(host: str, port: int) -> socket.socket:
    """The supervisor's socket: bound to ``host:port`` (a free port if 0), not listening,
    so it takes no connection, while no worker listens (starting, or started again).

    First a bind as any server binds (``SO_REUSEADDR`` alone), which fails if anything
    listens there: another collector, ours included, must not join this one's workers.
    Then held with ``SO_REUSEPORT`` alone, which refuses such a server meanwhile and
    admits the workers' sockets. Without ``SO_REUSEADDR`` that bind fails while an
    earlier server's connections on the port are in TIME_WAIT (up to a minute): then
    held as the workers bind, which only another ``SO_REUSEPORT`` socket of this user
    could join."""
    if port:
        with _socket(host, reuse_addr=True, reuse_port=False) as probe:
            probe.bind((host, port))
    sock = _socket(host, reuse_addr=False, reuse_port=True)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        return listening_socket(host, port)
    return sock


def serve(workers: int, host: str, port: int, target: Target, *, timeout_s: float) -> int | None:
    """Run ``target(host, port, beat)`` in ``workers`` processes, each binding its own
    socket and stamping ``beat`` as its event loop turns, until they exit; a worker that
    dies unasked is started again, so is one silent for ``timeout_s`` (killed), and SIGHUP
    starts every worker again. Returns the signal that stopped them (SIGINT or SIGTERM),
    None if they exited by themselves."""
    try:
        held = hold_port(host, port)  # the port, also when 0 asked for any free one
    except OSError as exc:  # as uvicorn says it, and exits
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        log.error("could not bind %s: %s", where, exc.strerror or exc)
        raise SystemExit(1) from None
    port = held.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    stopped: list[int] = []
    procs: list[BaseProcess | None] = [None] * workers  # None: waiting to be started
    started = [0.0] * workers
    due = [0.0] * workers  # when a waiting slot is started
    backoff = [0.0] * workers  # seconds, doubled by each failure as it started
    beats: list[Beat | None] = [None] * workers
    killed: set[int | None] = set()  # workers killed for a loop that stopped turning
    signalled: dict[int | None, float] = {}  # pid: when it was asked to stop (SIGTERM)

    def terminate(p: BaseProcess) -> None:
        if p.pid is not None and p.exitcode is None:
            signalled.setdefault(p.pid, time.monotonic())
            with contextlib.suppress(ProcessLookupError):  # reaped meanwhile
                os.kill(p.pid, signal.SIGTERM)

    def start(i: int) -> None:
        if stopped:
            return
        try:
            beat: Beat = ctx.RawValue("d", 0.0)
            p = ctx.Process(target=target, args=(host, port, beat), name="stepwatch-web")
            p.start()
        except OSError as exc:  # no process to be had (memory, limits): try again later
            log.error("could not start a web worker: %s", exc)
            backoff[i] = min(MAX_BACKOFF_S, 2 * backoff[i] or 1.0)
            due[i] = time.monotonic() + backoff[i]
            return
        procs[i], started[i], beats[i] = p, time.monotonic(), beat
        if stopped:  # a signal came while it started
            terminate(p)

    def running() -> list[BaseProcess]:
        return [p for p in procs if p is not None and p.exitcode is None]

    def stop(signum: int, _frame: FrameType | None) -> None:
        stopped.append(signum)
        for p in running():
            terminate(p)

    def kill_hung(now: float, since: float) -> None:
        """SIGKILL each serving worker whose loop has not turned for ``timeout_s``, and
        each asked to stop that has not in ``timeout_s``; silence counts from ``since`` at
        the earliest (when the supervisor last ran on time)."""
        for p, beat in zip(procs, beats, strict=True):
            if p is None or p.pid is None or beat is None or p.exitcode is not None or p.pid in killed:
                continue
            asked_at = signalled.get(p.pid)
            if asked_at is not None:
                why = "did not stop within %.0f s of SIGTERM"
                silent = now - max(asked_at, since)
            else:
                why = "its event loop has not turned for %.0f s"
                silent = now - max(beat.value, since) if beat.value else 0.0
            if silent > timeout_s:
                log.error("web worker %d: " + why + "; killing it", p.pid, silent)
                killed.add(p.pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)  # also ends a stopped (SIGSTOP) process

    def restart_all(_signum: int, _frame: FrameType | None) -> None:
        log.warning("SIGHUP: starting every web worker again")
        for p in running():
            terminate(p)

    # Before the first worker: a signal from here on reaches every worker started.
    handlers = {signal.SIGINT: stop, signal.SIGTERM: stop, signal.SIGHUP: restart_all}
    previous = {s: signal.signal(s, h) for s, h in handlers.items()}
    try:
        for i in range(workers):
            start(i)
        first = True  # no worker has run STARTUP_S yet: a failure is the configuration's
        on_time = last_poll = time.monotonic()  # since when the supervisor ran on time
        while True:
            alive = running()  # one snapshot: a worker exiting after it still wakes wait()
            waiting = [] if stopped else [due[i] for i, p in enumerate(procs) if p is None]
            if not alive and not waiting:
                break
            timeout = min(POLL_S, max(0.0, min(waiting) - time.monotonic())) if waiting else POLL_S
            wait([p.sentinel for p in alive], timeout)
            now = time.monotonic()
            if now - last_poll > LATE_S:  # paused, or starved: the workers were too
                on_time = now
            last_poll = now
            kill_hung(now, on_time)
            if any(p is not None and now - started[i] >= STARTUP_S for i, p in enumerate(procs)):
                first = False
            for i, p in enumerate(procs):
                if p is None:
                    if now >= due[i]:
                        start(i)
                    continue
                if now - started[i] >= STARTUP_S:
                    backoff[i] = 0.0
                if p.exitcode is None or stopped:
                    continue
                p.join()
                # Signalled while the collector runs: SIGHUP asked it to stop, to be started
                # again (one stopped before it started exits 3 too: not a failure then).
                quick = p.exitcode > 0 and now - started[i] < STARTUP_S and p.pid not in signalled
                killed.discard(p.pid)
                signalled.pop(p.pid, None)
                if quick and first:  # the app or the socket cannot start: nor will another
                    log.error("web worker %d exited with %s as it started; stopping", p.pid, p.exitcode)
                    stop(0, None)
                    break
                backoff[i] = min(MAX_BACKOFF_S, 2 * backoff[i] or 1.0) if quick else 0.0
                log.warning(
                    "web worker %d exited with %s; starting another in %.0f s", p.pid, p.exitcode, backoff[i]
                )
                procs[i], due[i] = None, now + backoff[i]
        for p in procs:
            if p is not None:
                p.join()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        held.close()
    if stopped and stopped[0] == 0:
        raise SystemExit(1)
    return stopped[0] if stopped else None
