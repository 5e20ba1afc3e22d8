"""Process management for the demo and the end-to-end tests: a collector process and
N training ranks on loopback, always cleaned up (also on Ctrl-C), never orphaned."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

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


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
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
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Start ``n`` gloo ranks of ``stepwatch.demo.train`` with torchrun's environment."""
    master_port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
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
            with open(os.path.join(log_dir, f"rank{r}.log"), "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "stepwatch.demo.train", *train_args],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=rank_env,
                    )
                )
        yield procs
    finally:
        for p in procs:
            _stop(p, grace_s=2.0)


def poll_all(procs: Sequence[subprocess.Popen[bytes]], log_dir: str) -> bool:
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


def wait_all(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float, log_dir: str) -> None:
    """Wait for every rank; if one fails, stop the others and raise with its log."""
    deadline = time.monotonic() + timeout_s
    while not poll_all(procs, log_dir):
        if time.monotonic() > deadline:
            running = [r for r, p in enumerate(procs) if p.poll() is None]
            raise TimeoutError(f"ranks {running} still running after {timeout_s} s")
        time.sleep(0.05)
