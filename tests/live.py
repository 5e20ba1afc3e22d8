"""Real collectors for the tests: uvicorn in a thread, `stepwatch serve` as a killable
process, and a collector that is up but answers only after a delay."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from stepwatch.demo.launch import free_port, wait_ready
from stepwatch_server.app import create_app
from stepwatch_server.settings import Settings

from .wait import wait_until


@contextmanager
def serve_in_thread(database_url: str, port: int | None = None, **settings: object) -> Iterator[str]:
    port = port or free_port()
    app = create_app(Settings(database_url=database_url, **settings))  # type: ignore[arg-type]
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()

    def started() -> bool:  # uvicorn sets this once the socket listens
        if not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        return bool(server.started)

    wait_until(started, "uvicorn to listen", timeout_s=20, every_s=0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


class CollectorProcess:
    """``stepwatch serve`` as a real process on a fixed port, which a test may SIGKILL
    and start again on the same port (agents keep their URL)."""

    def __init__(self, database_url: str, log_path: str, port: int | None = None, **env: str) -> None:
        self.database_url, self.log_path = database_url, log_path
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = env
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        cmd = [sys.executable, "-m", "stepwatch", "serve", "--port", str(self.port)]
        cmd += ["--database-url", self.database_url, "--log-level", "warning"]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env}
            )
        wait_ready(self.url, self.process, 60.0, self.log_path)

    def kill(self) -> None:
        """SIGKILL: no shutdown handler runs, nothing is flushed."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@contextmanager
def collector_process(database_url: str, log_path: str, **env: str) -> Iterator[CollectorProcess]:
    proc = CollectorProcess(database_url, log_path, **env)
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


class SlowServer:
    """A loopback HTTP server that reads each request and answers 200 only after
    ``delay_s`` (or when released): a collector that is up but too slow to answer.
    Counts the requests it has received."""

    def __init__(self, delay_s: float = 10.0) -> None:
        import socket

        self.delay_s = delay_s
        self.received = 0
        self.release = threading.Event()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> SlowServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.release.set()
        self._thread.join(5)
        self._sock.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: Any) -> None:
        with conn:
            conn.settimeout(30)
            try:
                while True:
                    data = b""
                    while b"\r\n\r\n" not in data:
                        chunk = conn.recv(65536)
                        if not chunk:
                            return
                        data += chunk
                    head, _, body = data.partition(b"\r\n\r\n")
                    length = next(
                        (
                            int(v)
                            for k, _, v in (h.partition(b":") for h in head.split(b"\r\n"))
                            if k.strip().lower() == b"content-length"
                        ),
                        0,
                    )
                    while len(body) < length:
                        body += conn.recv(65536)
                    self.received += 1
                    self.release.wait(self.delay_s)
                    reply = b'{"stored":true}'
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                        + str(len(reply)).encode()
                        + b"\r\n\r\n"
                        + reply
                    )
            except OSError:
                return
