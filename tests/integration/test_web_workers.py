"""``stepwatch serve --workers 2`` on Linux (``api/workers.py``): each web worker listens
on a socket of its own, so a burst of keep-alive connections (a job's ranks connecting at
once) is dealt among the workers rather than taken by whichever was accepting; a worker
that dies is started again, SIGHUP starts them all again; SIGTERM stops them all and
``serve`` dies of it.

Real processes, found by their parent in ``/proc``; each connection's worker is the
process holding its socket's inode (``/proc/net/tcp`` against ``/proc/PID/fd``). With
the workers sharing one listening socket (uvicorn's own), 128 connections to 2 workers
were split 103/25 and 128/0 in two of three bursts measured; dealt by hash, more than
80% of 64 on one worker has a chance of about 5 in 10 million."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path

import httpx
import pytest

from stepwatch.demo import launch
from stepwatch_server.api import workers
from stepwatch_server.settings import Settings

from .. import pg
from ..wait import wait_until

CONNECTIONS = 64
ENV = {"STEPWATCH_WORKERS": "2", "STEPWATCH_ANALYSIS_ENABLED": "false"}


def _workers(serve: int) -> list[int]:
    """``serve``'s live children but multiprocessing's resource tracker."""
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        state, ppid = stat.rpartition(")")[2].split()[:2]
        if int(ppid) == serve and state != "Z" and b"resource_tracker" not in cmdline:
            kids.append(int(entry))
    return sorted(kids)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _listening(pid: int, port: int) -> bool:
    """Whether ``pid`` holds a socket listening on ``port``."""
    return bool(_inodes(port, "0A") & _socket_inodes(pid))


def _inodes(port: int, state: str) -> set[str]:
    """Inodes of the TCP sockets on local ``port`` in ``state`` (01: established, 0A: listen)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                f = line.split()
                if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == state:
                    found.add(f[9])
    return found


def _socket_inodes(pid: int) -> set[str]:
    held = set()
    with suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    held.add(target[8:-1])
    return held


@contextmanager
def _connections(port: int, n: int) -> Iterator[list[socket.socket]]:
    """``n`` keep-alive connections opened at once, each answered one request."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.create_connection(("127.0.0.1", port))) for _ in range(n)]
        for s in socks:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        for s in socks:
            assert s.recv(65536).startswith(b"HTTP/1.1 200"), "a connection was not answered"
        yield socks


def _served_by(workers: list[int], port: int) -> dict[int, int]:
    established = _inodes(port, "01")
    return {w: len(established & _socket_inodes(w)) for w in workers}


def _listening_workers(serve: int, port: int, other_than: int = 0) -> list[int] | None:
    """``serve``'s two workers once both listen on ``port`` (and neither is ``other_than``)."""
    w = _workers(serve)
    ok = len(w) == 2 and other_than not in w and all(_listening(p, port) for p in w)
    return w if ok else None


def test_connections_are_dealt_among_the_workers_a_dead_one_is_replaced_and_sigterm_stops_all(
    pg_admin: str, tmp_path: Path
) -> None:
    log_path = str(tmp_path / "collector.log")
    with pg.fresh_database(pg_admin) as db, launch.collector(db, log_path=log_path, env=ENV) as col:
        serve, port = col.process.pid, int(col.url.rsplit(":", 1)[1])

        pids = wait_until(lambda: _listening_workers(serve, port), "two web workers listening", timeout_s=60)
        # A socket each: the supervisor's own holds the port without listening.
        assert not _listening(serve, port)
        with _connections(port, CONNECTIONS):
            served = _served_by(pids, port)
        assert sum(served.values()) == CONNECTIONS, served
        assert max(served.values()) <= 0.8 * CONNECTIONS, served

        os.kill(pids[0], signal.SIGKILL)
        replaced = f"a web worker in place of {pids[0]} (children: {_workers(serve)})"
        try:
            again = wait_until(
                lambda: _listening_workers(serve, port, other_than=pids[0]), replaced, timeout_s=60
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}; now {_workers(serve)}; the log:\n{col.log()}") from None
        assert pids[1] in again
        with _connections(port, CONNECTIONS):
            served = _served_by(again, port)
        assert sum(served.values()) == CONNECTIONS and min(served.values()) > 0, served
        assert httpx.get(f"{col.url}/readyz").status_code == 200

        # SIGHUP starts every worker again (as uvicorn's supervisor did), and they serve.
        col.process.send_signal(signal.SIGHUP)
        fresh = wait_until(
            lambda: (w := _listening_workers(serve, port)) and not set(w) & set(again) and w,
            "two new web workers after SIGHUP",
            timeout_s=60,
        )
        assert httpx.get(f"{col.url}/readyz").status_code == 200

        col.process.terminate()
        assert col.process.wait(30) == -signal.SIGTERM
        assert not any(_alive(p) for p in fresh), "a web worker outlived serve"
        log = col.log()
    assert "exited with -9; starting another" in log, log


def test_a_worker_whose_event_loop_stopped_is_killed_and_replaced(pg_admin: str, tmp_path: Path) -> None:
    """A worker frozen (SIGSTOP: its loop stops turning, its socket still listens, and the
    kernel would go on dealing it connections no one answers) is SIGKILLed once its loop
    has not turned for ``worker_timeout_s``, and another takes its place and serves."""
    log_path = str(tmp_path / "collector.log")
    env = {**ENV, "STEPWATCH_WORKER_TIMEOUT_S": "2"}
    with pg.fresh_database(pg_admin) as db, launch.collector(db, log_path=log_path, env=env) as col:
        serve, port = col.process.pid, int(col.url.rsplit(":", 1)[1])

        pids = wait_until(lambda: _listening_workers(serve, port), "two web workers listening", timeout_s=60)
        os.kill(pids[0], signal.SIGSTOP)
        try:
            wait_until(
                lambda: _listening_workers(serve, port, other_than=pids[0]),
                f"a web worker in place of the stopped {pids[0]}",
                timeout_s=60,
            )
        finally:
            if _alive(pids[0]):  # not killed: ours to end
                os.kill(pids[0], signal.SIGKILL)
        assert httpx.get(f"{col.url}/readyz").status_code == 200
        log = col.log()
    assert f"web worker {pids[0]}: its event loop has not turned for" in log, log
    assert f"web worker {pids[0]} exited with -9; starting another" in log, log


def _serve_on(port: int, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``stepwatch serve --workers 2`` on ``port`` (a database of its own), to its exit."""
    return subprocess.run(
        [sys.executable, "-m", "stepwatch", "serve", "--port", str(port), "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "STEPWATCH_DATABASE_URL": f"sqlite:///{tmp_path / 'c.db'}"},
    )


def test_a_port_in_use_stops_serve_with_the_reason(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = _serve_on(port, tmp_path)
    assert out.returncode == 1, out
    assert f"could not bind 127.0.0.1:{port}: Address already in use" in out.stderr, out.stderr


#: The hang timeout of the tests that are not about hangs: the collector's default.
TIMEOUT_S = Settings().worker_timeout_s


def _cannot_start(host: str, port: int, beat: workers.Beat) -> None:
    sys.exit(3)  # uvicorn's exit when its app fails to start


def test_workers_that_cannot_start_stop_the_supervisor_instead_of_starting_again() -> None:
    """A worker that exits with an error as it starts, before any worker ran: the
    configuration is wrong, and starting others would fail alike for ever."""
    with pytest.raises(SystemExit) as stopped:
        workers.serve(2, "127.0.0.1", 0, _cannot_start, timeout_s=TIMEOUT_S)
    assert stopped.value.code == 1


def _serves_until_stopped(host: str, port: int, beat: workers.Beat) -> None:
    """A worker that listens as the real ones do, names itself in ``$PIDS`` and exits on
    SIGTERM (the default)."""
    sock = workers.listening_socket(host, port)
    sock.listen()
    (Path(os.environ["PIDS"]) / str(os.getpid())).touch()
    signal.pause()


def test_a_second_collector_on_the_port_is_refused_not_joined(pg_admin: str, tmp_path: Path) -> None:
    """The workers' sockets admit other SO_REUSEPORT sockets of this user: a second
    ``serve`` on the same port must fail as it would on any server, not join the first
    one's workers and take part of its agents."""
    log_path = str(tmp_path / "collector.log")
    with pg.fresh_database(pg_admin) as db, launch.collector(db, log_path=log_path, env=ENV) as col:
        out = _serve_on(int(col.url.rsplit(":", 1)[1]), tmp_path)
        assert out.returncode == 1, out
        assert "Address already in use" in out.stderr, out.stderr
        assert httpx.get(f"{col.url}/readyz").status_code == 200


def _ticks(host: str, port: int, beat: workers.Beat) -> None:
    """A worker that stamps its beat ten times a second, as a serving one does; each stamp
    a file in ``$PIDS/<pid>/`` (how many it made, and since when)."""
    sock = workers.listening_socket(host, port)
    sock.listen()
    mine = Path(os.environ["PIDS"]) / str(os.getpid())
    mine.mkdir()
    for n in range(100_000):
        beat.value = time.monotonic()
        (mine / str(n)).touch()
        time.sleep(0.1)


def _supervise(n: int, target: str, tmp_path: Path, timeout_s: float) -> subprocess.Popen[bytes]:
    """``workers.serve(n, ..., target)`` in a process (a session) of its own."""
    code = (
        "import sys; from stepwatch_server.api import workers; "
        f"from tests.integration.test_web_workers import {target} as t; "
        f"sys.exit(workers.serve({n}, '127.0.0.1', 0, t, timeout_s={timeout_s}) or 0)"
    )
    env = {**os.environ, "PIDS": str(tmp_path)}
    return subprocess.Popen(
        [sys.executable, "-c", code], cwd=Path(__file__).parents[2], env=env, start_new_session=True
    )


def _stamps(tmp_path: Path, pid: int) -> int:
    return len(list((tmp_path / str(pid)).iterdir()))


def test_a_frozen_worker_does_not_keep_serve_from_stopping(tmp_path: Path) -> None:
    """SIGTERM stops the workers gracefully; one that does not stop (frozen) is killed
    ``timeout_s`` after the signal, and the supervisor returns (it waited for ever)."""
    sup = _supervise(2, "_ticks", tmp_path, timeout_s=2)
    try:
        pids = wait_until(lambda: len(w := _workers(sup.pid)) == 2 and w, "two workers", timeout_s=60)
        os.kill(pids[0], signal.SIGSTOP)
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(60) == signal.SIGTERM, "the supervisor returns the signal that stopped it"
    finally:
        os.killpg(sup.pid, signal.SIGKILL)
    assert not any(_alive(p) for p in pids), "a worker outlived its supervisor"


def test_workers_paused_with_their_supervisor_are_not_taken_for_hung(tmp_path: Path) -> None:
    """The whole collector stopped longer than ``timeout_s`` (Ctrl-Z, a paused container)
    and resumed: no worker ticked meanwhile, but neither did the supervisor; it must not
    kill them for the silence of the pause."""
    sup = _supervise(2, "_ticks", tmp_path, timeout_s=2)
    try:
        pids = wait_until(
            lambda: len(w := _workers(sup.pid)) == 2 and all((tmp_path / str(p)).is_dir() for p in w) and w,
            "two workers ticking",
            timeout_s=60,
        )
        os.killpg(sup.pid, signal.SIGSTOP)
        time.sleep(workers.LATE_S + 2)  # the pause itself: longer than timeout_s and LATE_S
        before = {p: _stamps(tmp_path, p) for p in pids}
        os.killpg(sup.pid, signal.SIGCONT)
        # Ten ticks each after the resume: the supervisor (polling every 0.5 s) has looked.
        wait_until(
            lambda: all(_stamps(tmp_path, p) >= before[p] + 10 for p in pids if _alive(p)),
            "ten ticks of each worker after the resume",
            timeout_s=60,
        )
        assert sorted(_workers(sup.pid)) == sorted(pids), "a paused worker was killed on resume"
        assert all(_alive(p) for p in pids)
    finally:
        os.killpg(sup.pid, signal.SIGKILL)


def test_sigterm_while_the_workers_start_stops_every_one(tmp_path: Path) -> None:
    """SIGTERM as soon as the first of six workers exists, while the others are being
    started: each is stopped, those started after the signal too, and the supervisor
    returns (it waited for ever on a worker it had started after the signal)."""
    code = (
        "import sys; from stepwatch_server.api import workers; "
        "from tests.integration.test_web_workers import _serves_until_stopped as t; "
        f"sys.exit(workers.serve(6, '127.0.0.1', 0, t, timeout_s={TIMEOUT_S}) or 0)"
    )
    env = {**os.environ, "PIDS": str(tmp_path)}
    sup = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).parents[2], env=env)
    try:
        wait_until(lambda: _workers(sup.pid), "a worker started", timeout_s=60, every_s=0.001)
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(60) == signal.SIGTERM, "the supervisor returns the signal that stopped it"
    finally:
        sup.kill()
        pids = [int(f.name) for f in tmp_path.iterdir()]
        alive = [p for p in pids if _alive(p)]
        for p in alive:  # orphans of a failed run: ours to stop
            os.kill(p, signal.SIGKILL)
    assert not alive, "a worker outlived its supervisor"
