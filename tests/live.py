"""Real collectors for the tests: uvicorn in a thread, `stepwatch serve` as a killable
process, and a collector that is up but answers only after a delay."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from starlette.types import ASGIApp

from stepwatch.demo.launch import free_port, wait_ready
from stepwatch_server.api.timeouts import uvicorn_options
from stepwatch_server.app import create_app
from stepwatch_server.settings import Settings

from .wait import wait_until


@contextmanager
def serve_in_thread(
    database_url: str,
    port: int | None = None,
    wrap: Callable[[ASGIApp], ASGIApp] | None = None,
    **settings: object,
) -> Iterator[str]:
    """The real collector app served by uvicorn in a thread (``wrap``: around the app, to
    watch its requests)."""
    port = port or free_port()
    config = Settings(database_url=database_url, **settings)  # type: ignore[arg-type]
    app: ASGIApp = create_app(config)
    if wrap is not None:
        app = wrap(app)
    server = uvicorn.Server(
        uvicorn.Config(
            app, host="127.0.0.1", port=port, log_level="warning", lifespan="on", **uvicorn_options(config)
        )
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
            # A SIGKILLed serve leaves its counters' directory: in the test's, not /tmp.
            env = {**os.environ, "TMPDIR": os.path.dirname(os.path.abspath(self.log_path)), **self.env}
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
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


class LoopbackServer:
    """A loopback HTTP/1.1 server (keep-alive) that answers each request with
    ``respond(body)``: a collector that behaves as a test needs (slow, failing on one
    batch, ...) where the real one cannot be made to. Keeps the bodies it received."""

    def __init__(self) -> None:
        import socket

        self.bodies: list[bytes] = []
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def received(self) -> int:
        return len(self.bodies)

    def respond(self, body: bytes) -> tuple[int, dict[str, str], bytes]:
        return 200, {}, b'{"stored":true}'

    def __enter__(self) -> Any:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
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
                    self.bodies.append(body)
                    status, headers, reply = self.respond(body)
                    head_out = f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
                    head_out += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
                    head_out += f"content-length: {len(reply)}\r\n\r\n"
                    conn.sendall(head_out.encode() + reply)
            except OSError:
                return


class SlowServer(LoopbackServer):
    """Answers 200 only after ``delay_s`` (or when released): a collector that is up but
    too slow to answer."""

    def __init__(self, delay_s: float = 10.0) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.release = threading.Event()

    def respond(self, body: bytes) -> tuple[int, dict[str, str], bytes]:
        self.release.wait(self.delay_s)
        return super().respond(body)

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        super().__exit__(*exc)
