"""Real Prometheus and Alertmanager processes on loopback ports, and a webhook sink.

Each server is started as a child process on a free port, polled until ready (a condition
with a deadline, never a fixed sleep) and stopped by its own PID. Binaries come from
Debian's ``prometheus`` and ``prometheus-alertmanager`` packages (``.ci/run`` installs
them); a missing binary fails the test with the install command.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import yaml

from stepwatch.demo.launch import free_port

from ..wait import wait_until

INSTALL = "apt-get install -y --no-install-recommends prometheus prometheus-alertmanager"


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} not found; install it: {INSTALL}")
    return path


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, 10 s to exit, then SIGKILL; reaped either way."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 20.0) -> None:
    def ready() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            return httpx.get(url, timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(ready, f"{url} to be ready", timeout_s=timeout_s, every_s=0.1)
    except AssertionError as exc:
        raise TimeoutError(f"{exc}:\n{log.read_text()[-3000:]}") from None


@contextmanager
def process(cmd: list[str], ready_url: str, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_ready(ready_url, proc, log)
        yield proc
    finally:
        stop(proc)


@contextmanager
def prometheus(workdir: Path, *, scrape: str, rules: Path, alertmanager: str | None) -> Iterator[str]:
    """Prometheus scraping ``scrape`` (host:port, job ``stepwatch``) every second."""
    port = free_port()
    config: dict[str, Any] = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules)],
        "scrape_configs": [{"job_name": "stepwatch", "static_configs": [{"targets": [scrape]}]}],
    }
    if alertmanager:
        config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]}
    cfg = workdir / "prometheus.yml"
    cfg.write_text(yaml.safe_dump(config))
    url = f"http://127.0.0.1:{port}"
    cmd = [
        binary("prometheus"),
        f"--config.file={cfg}",
        f"--storage.tsdb.path={workdir / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
    ]
    with process(cmd, f"{url}/-/ready", workdir / "prometheus.log"):
        yield url


@contextmanager
def alertmanager(workdir: Path, config: dict[str, Any]) -> Iterator[str]:
    port = free_port()
    cfg = workdir / "alertmanager.yml"
    cfg.write_text(yaml.safe_dump(config))
    url = f"http://127.0.0.1:{port}"
    cmd = [
        binary("prometheus-alertmanager"),
        f"--config.file={cfg}",
        f"--storage.path={workdir / 'am'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--cluster.listen-address=",
        "--log.level=warn",
    ]
    with process(cmd, f"{url}/-/ready", workdir / "alertmanager.log"):
        yield url


class Sink:
    """Collects the JSON bodies POSTed to it (what Alertmanager sends to Slack)."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def received(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.bodies)

    def add(self, body: dict[str, Any]) -> None:
        with self._lock:
            self.bodies.append(body)


@contextmanager
def webhook_sink() -> Iterator[tuple[str, Sink]]:
    sink = Sink()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            sink.add(json.loads(self.rfile.read(length) or b"{}"))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/slack", sink
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
