"""A real collector served by uvicorn on a loopback port, inside the test process."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from stepwatch.demo.launch import free_port
from stepwatch_server.app import create_app
from stepwatch_server.settings import Settings


@contextmanager
def serve_in_thread(database_url: str, port: int | None = None, **settings: object) -> Iterator[str]:
    port = port or free_port()
    app = create_app(Settings(database_url=database_url, **settings))  # type: ignore[arg-type]
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:  # uvicorn sets this once the socket listens
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
