"""What every benchmark needs: a fresh PostgreSQL database and server processes that
are always stopped, and a condition poll instead of a sleep."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence

import httpx

from stepwatch.demo.launch import free_port
from stepwatch_server.storage import migrate
from tests import pg


@contextlib.contextmanager
def pg_database(prefix: str = "stepwatch_bench") -> Iterator[str]:
    """A fresh database at head on the test PostgreSQL (see ``tests/pg.py``); dropped after."""
    with pg.admin_url() as admin, pg.fresh_database(admin, prefix=prefix) as url:
        migrate.upgrade(url)
        yield url


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 600.0) -> None:
    # Generous: at load 30 on the shared 2 cores, importing the collector took 1-3 minutes.
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer 200 within {timeout_s} s")


class ServerURL(str):
    """A server's base URL that also names its process (whose CPU a benchmark may read)."""

    pid: int


@contextlib.contextmanager
def server(args: Sequence[str], ready_path: str, env: dict[str, str] | None = None) -> Iterator[ServerURL]:
    """Run ``python -m ARGS --port P`` until exit; yield its base URL once ``ready_path`` answers."""
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="stepwatch-bench-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", *args, "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )
    url = ServerURL(f"http://127.0.0.1:{port}")
    url.pid = proc.pid
    try:
        wait_http(url + ready_path, proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        os.unlink(log.name)


def median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
