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
import threading
import time
import types
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

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


def _srun_env(r: int, n: int) -> dict[str, str]:
    """What a Slurm ``srun`` step of ``n`` tasks on one node sets in task ``r``'s
    environment (the variables the agent reads), for :func:`ranks`' ``launcher="srun"``."""
    return {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": str(r),
        "SLURM_LOCALID": str(r),
        "SLURM_NODEID": "0",  # srun 22.05 sets no SLURM_STEP_NODEID in a task's environment
        "SLURM_NTASKS": str(n),
        "SLURM_STEP_TASKS_PER_NODE": str(n),
    }


@contextlib.contextmanager
def ranks(
    n: int,
    train_args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    log_dir: str,
    launcher: Literal["torchrun", "srun"] = "torchrun",
) -> Iterator[list[RankProcess]]:
    """Start ``n`` gloo ranks of ``stepwatch.demo.train`` with torchrun's environment,
    forked from the preloaded server (:func:`forked`). ``launcher="srun"``: with what
    Slurm's ``srun`` sets instead, plus the rendezvous a job script exports for
    ``torch.distributed`` from it (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``); no ``LOCAL_RANK`` or ``LOCAL_WORLD_SIZE``, which ``srun`` does not set."""
    master_port = free_port()
    procs: list[RankProcess] = []
    try:
        for r in range(n):
            torchrun = {"LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(n)}
            launched = torchrun if launcher == "torchrun" else _srun_env(r, n)
            # Under srun, none of torchrun's local variables, whatever this process has.
            inherited = {k: v for k, v in os.environ.items() if launcher == "torchrun" or k not in torchrun}
            rank_env = {
                **inherited,
                **(env or {}),
                **launched,
                "RANK": str(r),
                "WORLD_SIZE": str(n),
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
    "stepwatch.demo._forkserver_env",  # first: the environment the server started with
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch._dynamo",
    "stepwatch",
    "stepwatch.demo.model",
)

#: The variables a rank may have that the forkserver has not (or has otherwise): the ones
#: read only once the rank's own code runs (torch.distributed's rendezvous, gloo's first
#: connection, the agent's ``init``, the terminal's size when output is laid out; pytest's
#: marker of the current test). Any other difference (``OMP_NUM_THREADS`` or
#: ``MALLOC_ARENA_MAX`` read when a library loads, ``TORCH_LOGS`` or
#: ``TORCH_DISTRIBUTED_DEBUG`` when torch is imported, ``PYTHON*`` or ``LANG`` when the
#: interpreter starts) and the rank is started as a fresh interpreter.
_READ_LATER = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        *_srun_env(0, 1),
        "GLOO_SOCKET_IFNAME",
        "COLUMNS",
        "LINES",
        "PYTEST_CURRENT_TEST",
    }
)
#: The allocator settings glibc's ``mallopt`` sets in a running process as these variables
#: do at its start (each also fixes the mmap threshold, as the variable does): the
#: forkserver starts without them and a rank applies those it asks for, so one server
#: serves the harness' ranks (``evaluation.real.MALLOC_ENV``) and the demo's (the
#: allocator's defaults, as a user's job has).
_MALLOPT = {"MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_TOP_PAD_": -2, "MALLOC_MMAP_THRESHOLD_": -3}


def _fixed(env: Mapping[str, str]) -> dict[str, str]:
    """The part of ``env`` a forked rank must share with its forkserver."""
    return {
        k: v
        for k, v in env.items()
        if k not in _READ_LATER and k not in _MALLOPT and not k.startswith("STEPWATCH_")
    }


def _mallopt(env: Mapping[str, str]) -> bool:
    """Apply ``env``'s :data:`_MALLOPT` settings to this process; False where one could not
    be (not glibc, or a value mallopt's ``int`` cannot hold: glibc then parses it itself)."""
    asked = {k: v for k, v in env.items() if k in _MALLOPT}
    if not asked:
        return True
    try:
        values = {k: int(v) for k, v in asked.items()}
        if not all(0 <= v < 2**31 for v in values.values()):
            return False
        libc = ctypes.CDLL(None)
        return all(libc.mallopt(ctypes.c_int(_MALLOPT[k]), ctypes.c_int(v)) == 1 for k, v in values.items())
    except Exception:
        return False


_CLONE_NEWNET = 0x40000000


def _enter_netns(name: str) -> None:
    """Join the network namespace ``ip netns add`` made (what ``ip netns exec`` does for
    the network; ``os.setns`` is Python 3.12's). Nothing in the ranks reads ``/sys`` or
    ``/etc/netns``, the parts of ``ip netns exec`` left out."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _why_fresh(started: Mapping[str, str] | None, env: Mapping[str, str]) -> str:
    """Why a rank asking for ``env`` cannot be forked from a server that started with
    ``started`` (and applies ``env``'s :data:`_MALLOPT` settings where it can); "" if it can."""
    if started is None:
        return "the forkserver was not started by launch.forked"
    a, b = _fixed(started), _fixed(env)
    if differ := sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k)):
        return f"{', '.join(differ[:5])} differ from the forkserver's"
    if set(started) & set(_MALLOPT):
        return "the forkserver started with allocator settings"
    if not _mallopt(env):
        return "mallopt could not apply the allocator settings"
    return ""


def _run_forked(
    module: str, argv: list[str], env: dict[str, str], log_path: str, nice: int, netns: str | None
) -> None:
    """In the forked child: become what ``[ip netns exec NS] [nice -n N] python -m module
    argv`` with ``env`` and its output to ``log_path`` would be, then run the module and
    leave as the interpreter would (its threads joined, then the exit handlers, C's
    buffers flushed; an uncaught ``KeyboardInterrupt`` is death by SIGINT). What stays
    the forkserver's: ``sys.path`` and the interpreter's flags (the launcher's, as
    ``python -m`` would have them), and the hash seed, shared by the ranks."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT, 0o644)  # made empty by forked()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if netns is not None:
        _enter_netns(netns)
    if nice:
        os.nice(nice)
    # The forkserver's environment as it started (None: a server this module did not start).
    started: dict[str, str] | None = getattr(
        sys.modules.get("stepwatch.demo._forkserver_env"), "AT_START", None
    )
    why = _why_fresh(started, env)
    if why or started is None:
        print(f"stepwatch.demo.launch: a fresh interpreter, not forked: {why}", file=sys.stderr, flush=True)
        os.execve(sys.executable, [sys.executable, "-m", module, *argv], env)
    # The asked environment, with what the preloaded imports added to it, as they would
    # have in the rank (torch._dynamo's TORCHINDUCTOR_CACHE_DIR).
    added = {k: v for k, v in os.environ.items() if k not in started and k not in env}
    os.environ.clear()
    os.environ.update({**env, **added})
    # Fresh streams on the log, buffered as an interpreter's on a file are; the rank's own
    # default start method (multiprocessing's child of a forkserver inherits that method).
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)  # noqa: SIM115
    multiprocessing.set_start_method(None, force=True)
    sys.argv = [module, *argv]
    interrupted = False
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        interrupted = True
        sys.excepthook(*sys.exc_info())
    except BaseException:
        sys.excepthook(*sys.exc_info())
        raise SystemExit(1) from None
    finally:
        # A forkserver's child leaves with os._exit: what the interpreter does at exit.
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        with contextlib.suppress(Exception):
            ctypes.CDLL(None).fflush(None)
        if interrupted:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)


class Forked:
    """A rank forked from the forkserver, with :class:`RankProcess`'s methods. Signals go
    through a pidfd where the kernel has them (Linux 5.3), so that one sent after the rank
    exited (the forkserver reaps it at once, and its pid may be taken again) reaches
    nobody; elsewhere through its pid, once its exit was not seen."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self._process = process
        assert process.pid is not None
        self.pid: int = process.pid
        self._pidfd: int | None = None
        with contextlib.suppress(AttributeError, OSError):  # no pidfd_open, or exited and reaped
            self._pidfd = os.pidfd_open(self.pid)

    def poll(self) -> int | None:
        code = self._process.exitcode
        if code is not None and self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        return code

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, sig)
            else:
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_server_lock = threading.Lock()
_server_started = False


def _start_server(env: Mapping[str, str]) -> None:
    """Start this process' forkserver, once, with :data:`PRELOAD` and exactly ``env``'s
    :func:`_fixed` part as its environment (Python's forkserver takes the caller's). The
    environment is swapped for that moment only, before any rank exists; a forkserver
    that was already running (another user of it in this process) is left as it is: its
    ranks whose environment differs start as fresh interpreters."""
    global _server_started
    with _server_lock:
        if _server_started:
            return
        saved = dict(os.environ)
        try:
            os.environ.clear()
            os.environ.update(_fixed(env))
            multiprocessing.set_forkserver_preload(list(PRELOAD))
            multiprocessing.forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _server_started = True


def forked(
    module: str,
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    log_path: str,
    nice: int = 0,
    netns: str | None = None,
) -> RankProcess:
    """``python -m module argv`` with exactly ``env``, its output to ``log_path``, at
    niceness ``nice`` above the forkserver's, in network namespace ``netns``: forked from
    this process' forkserver (Python's, started at the first call, :func:`_start_server`),
    so the rank starts at its own code. Still a process of its own with its own gloo
    group. A rank whose environment differs from the forkserver's in more than what is
    read later (:data:`_READ_LATER`, ``STEPWATCH_*``, :data:`_MALLOPT`) is started as a
    fresh interpreter (``execve``), never with the wrong variables; so is every rank
    where Python has no forkserver (not Unix)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        with open(log_path, "wb") as log:
            cmd = [*(["nice", "-n", str(nice)] if nice else []), sys.executable, "-m", module, *argv]
            cmd = ["ip", "netns", "exec", netns, *cmd] if netns else cmd
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(env))
    _start_server(env)
    with open(log_path, "wb"):  # there on return, as with Popen
        pass
    p = multiprocessing.get_context("forkserver").Process(
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
