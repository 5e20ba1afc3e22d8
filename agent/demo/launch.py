"""Process management for the demo, the evaluation harness and the end-to-end tests: a
collector process and N training ranks on loopback, always cleaned up (also on Ctrl-C),
never orphaned. Ranks are forked from a server that imported torch once (:func:`forked`)."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import multiprocessing
import multiprocessing.forkserver
import os
import random
import runpy
import signal
import socket
import subprocess
import sys
import time
import types
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import httpx

#: Ports tried below the kernel's ephemeral range (see :func:`free_port`).
PORT_SPAN = 12_000


def _ephemeral_low() -> int:
    """The first port of the kernel's range for outgoing connections (Linux: 32768)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback port free now, for a server about to bind it, chosen below the kernel's
    ephemeral range. Why not ``bind(0)``: that port comes from the range outgoing
    connections take their local ports from, and between the probe's close and the
    server's bind any process's ``connect`` may take it (seen in the tests: a collector's
    ``bind`` failed with "address already in use" while ranks posted to another one).
    Below the range only another ``bind`` can, and the random pick makes two callers
    choosing the same port unlikely."""
    high = _ephemeral_low()
    low = max(1024, high - PORT_SPAN)
    rng = random.SystemRandom()
    for _ in range(200 if low < high else 0):  # no room below the range: the kernel's pick
        port = rng.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # nothing free below the range: the kernel's pick, as before
        s.bind(("127.0.0.1", 0))
        picked: int = s.getsockname()[1]
        return picked


def _stop(proc: RankProcess, grace_s: float = 5.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass
class Collector:
    url: str
    process: subprocess.Popen[bytes]
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


@contextlib.contextmanager
def collector(
    database_url: str, *, log_path: str, env: Mapping[str, str] | None = None, ready_timeout_s: float = 60.0
) -> Iterator[Collector]:
    """Run ``stepwatch serve`` as a real process on a free loopback port until exit."""
    port = free_port()
    cmd = [sys.executable, "-m", "stepwatch", "serve", "--port", str(port), "--database-url", database_url]
    cmd += ["--log-level", "warning"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, ready_timeout_s, log_path)
        yield Collector(url=url, process=proc, log_path=log_path)
    finally:
        _stop(proc)


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float, log_path: str) -> None:
    """Poll ``/readyz`` until the collector answers 200 (a condition, not a fixed sleep)."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                with open(log_path, errors="replace") as f:
                    raise RuntimeError(f"collector exited with {proc.returncode}:\n{f.read()[-3000:]}")
            try:
                if client.get(f"{url}/readyz").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"collector at {url} not ready after {timeout_s} s")


@contextlib.contextmanager
def ranks(
    n: int,
    train_args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    log_dir: str,
) -> Iterator[list[Forked]]:
    """Start ``n`` gloo ranks of ``stepwatch.demo.train`` with torchrun's environment,
    forked from the preloaded server (:func:`forked`)."""
    master_port = free_port()
    procs: list[Forked] = []
    try:
        for r in range(n):
            rank_env = {
                **os.environ,
                **(env or {}),
                "RANK": str(r),
                "LOCAL_RANK": str(r),
                "WORLD_SIZE": str(n),
                "LOCAL_WORLD_SIZE": str(n),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(master_port),
                "OMP_NUM_THREADS": "1",
            }
            log = os.path.join(log_dir, f"rank{r}.log")
            procs.append(forked("stepwatch.demo.train", train_args, env=rank_env, log_path=log))
        yield procs
    finally:
        for p in procs:
            _stop(p, grace_s=2.0)


def poll_all(procs: Sequence[RankProcess], log_dir: str) -> bool:
    """True once every rank exited 0; raises with the rank's log if one failed."""
    done = True
    for r, p in enumerate(procs):
        rc = p.poll()
        if rc is None:
            done = False
        elif rc != 0:
            with open(os.path.join(log_dir, f"rank{r}.log"), errors="replace") as f:
                raise RuntimeError(f"rank {r} exited with {rc}:\n{f.read()[-3000:]}")
    return done


def wait_all(procs: Sequence[RankProcess], timeout_s: float, log_dir: str) -> None:
    """Wait for every rank; if one fails, stop the others and raise with its log."""
    deadline = time.monotonic() + timeout_s
    while not poll_all(procs, log_dir):
        if time.monotonic() > deadline:
            running = [r for r, p in enumerate(procs) if p.poll() is None]
            raise TimeoutError(f"ranks {running} still running after {timeout_s} s")
        time.sleep(0.05)


class RankProcess(Protocol):
    """What the launchers and the harness use of a rank's process: ``subprocess.Popen``'s
    names and meanings (a return code of ``-N``: killed by signal N)."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


#: What the forkserver of :func:`forked` imports once. A rank started as a fresh
#: interpreter spends its first seconds importing torch and, in DDP's constructor,
#: ``torch._dynamo`` (DDP asks it for its optimizer mode): measured in the evaluation
#: harness, 4.4 s of imports and 3.8 s of constructor of the 9.1-9.8 s from launch to the
#: end of step 1, four ranks starting at once on 2 cores.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch._dynamo",
    "stepwatch",
    "stepwatch.demo.model",
)

#: Variables read once when a process starts (the C library's allocator settings, OpenMP's
#: thread count, the dynamic loader's, Python's own): a forked rank inherits them from the
#: forkserver, not from the environment it asks for. A rank that asks for other values of
#: these than the forkserver started with is started as a fresh interpreter instead.
_AT_START = ("OMP_", "MALLOC_", "GLIBC_TUNABLES", "LD_", "PYTHON")
#: The allocator settings that glibc's ``mallopt`` sets in a running process as the
#: variables do at its start (each also fixes the mmap threshold, as the variable does).
#: The forkserver starts without them and a rank applies those it asks for, so one server
#: serves the harness' ranks (``evaluation.real.MALLOC_ENV``) and the demo's (the
#: allocator's defaults, as a user's job has).
_MALLOPT = {"MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_TOP_PAD_": -2, "MALLOC_MMAP_THRESHOLD_": -3}


def _read_at_start(env: Mapping[str, str]) -> dict[str, str]:
    """``env``'s variables read at start that only a process' start can set."""
    return {k: v for k, v in env.items() if k.startswith(_AT_START) and k not in _MALLOPT}


def _mallopt(env: Mapping[str, str]) -> bool:
    """Apply ``env``'s :data:`_MALLOPT` settings to this process; False where one could not be."""
    asked = {k: v for k, v in env.items() if k in _MALLOPT}
    if not asked:
        return True
    try:
        libc = ctypes.CDLL(None)
        return all(libc.mallopt(_MALLOPT[k], int(v)) == 1 for k, v in asked.items())
    except (AttributeError, OSError, ValueError):  # not glibc, or a value glibc would parse itself
        return False


_CLONE_NEWNET = 0x40000000


def _enter_netns(name: str) -> None:
    """Join the network namespace ``ip netns add`` made (what ``ip netns exec`` does for
    the network; ``os.setns`` is Python 3.12's)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _run_forked(
    module: str, argv: list[str], env: dict[str, str], log_path: str, nice: int, netns: str | None
) -> None:
    """In the forked child: become what ``[ip netns exec NS] [nice -n N] python -m module
    argv`` with ``env`` and its output to ``log_path`` would be, then run the module."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if netns is not None:
        _enter_netns(netns)
    if nice:
        os.nice(nice)
    server = os.environ  # the forkserver's, as it started
    if (
        _read_at_start(server) != _read_at_start(env)
        or any(k in server for k in _MALLOPT)
        or not _mallopt(env)
    ):
        os.execve(sys.executable, [sys.executable, "-m", module, *argv], env)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        # A forkserver's child leaves with os._exit: run what the interpreter runs at exit.
        atexit._run_exitfuncs()


class Forked:
    """A rank forked from the forkserver, with :class:`RankProcess`'s methods. Signals go
    through a pidfd, so that one sent after the rank exited (the forkserver reaps it at
    once, and its pid may be taken again) reaches nobody."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self._process = process
        assert process.pid is not None
        self.pid: int = process.pid
        try:
            self._pidfd = os.pidfd_open(self.pid)
        except ProcessLookupError:  # exited and reaped already: nothing left to signal
            self._pidfd = -1

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout or 0.0)
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
        return code

    def send_signal(self, sig: int) -> None:
        if self._pidfd >= 0 and self._process.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def forked(
    module: str,
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    log_path: str,
    nice: int = 0,
    netns: str | None = None,
) -> Forked:
    """``python -m module argv`` with exactly ``env``, its output to ``log_path``, at
    niceness ``nice`` above the forkserver's, in network namespace ``netns``: forked from
    this process' forkserver (Python's, started at the first call with :data:`PRELOAD`
    and this process' environment, its variables read at start replaced by ``env``'s but
    for :data:`_MALLOPT`), so the rank starts at its own code. Still a process of its own
    with its own gloo group; a rank whose variables read at start differ from the
    forkserver's is started as a fresh interpreter in the same way (``execve``), never
    with the wrong ones."""
    ctx = multiprocessing.get_context("forkserver")
    wanted = _read_at_start(env)
    saved = {k: os.environ.get(k) for k in set(wanted) | {k for k in os.environ if k.startswith(_AT_START)}}
    try:  # the forkserver starts with exactly these, if it starts now
        for k in saved:
            os.environ.pop(k, None)
        os.environ.update(wanted)
        multiprocessing.set_forkserver_preload(list(PRELOAD))
        multiprocessing.forkserver.ensure_running()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    p = ctx.Process(
        target=_run_forked, args=(module, list(argv), dict(env), log_path, nice, netns), name=module
    )
    # Python's forkserver runs the parent's main module again in each child (as
    # ``__mp_main__``, for targets defined there): here that would be pytest's or the CLI's,
    # imports the rank does not need, or a script's unguarded code. The target lives in this
    # module, and the rank runs its own module as ``__main__``: the child is given none.
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        p.start()
    finally:
        sys.modules["__main__"] = main
    return Forked(p)
