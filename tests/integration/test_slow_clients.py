"""Real slow clients over loopback against a real uvicorn collector: a request that is not
read whole within the deadline gets 408 and its connection is closed, and concurrent
connections are capped (503 past the cap), while a well-behaved client is served.

Issue 15: 500 slow connections stayed open past 60 s, and one with a Content-Length
larger than its body was held for 90 s.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from stepwatch_server.api import timeouts
from stepwatch_server.storage import migrate

from ..live import serve_in_thread
from ..payloads import payload

DEADLINE_S = 1.0


@pytest.fixture
def url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    db = f"sqlite:///{tmp_path / 'slow.db'}"
    migrate.upgrade(db)
    monkeypatch.setenv("STEPWATCH_REQUEST_READ_TIMEOUT_S", str(DEADLINE_S))
    timeouts._deadline_s.cache_clear()
    try:
        with serve_in_thread(db, max_connections=20, analysis_enabled=False) as u:
            yield u
    finally:
        timeouts._deadline_s.cache_clear()


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def _answer(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (30 s at most)."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def test_slow_headers_and_short_bodies_are_timed_out(url: str) -> None:
    body = json.dumps(payload()).encode()
    slow_headers = _connect(url)
    slow_headers.sendall(b"POST /api/v1/ingest HTTP/1.1\r\nhost: x\r\n")  # never ends the headers
    short_body = _connect(url)
    short_body.sendall(
        b"POST /api/v1/ingest HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(body) + 100).encode() + b"\r\n\r\n" + body
    )
    silent = _connect(url)  # connects and sends nothing
    # recv() returns b"" once the server closes; the client's own 30 s timeout would raise.
    answers = [_answer(s) for s in (slow_headers, short_body, silent)]
    for a in answers:
        assert a.startswith(b"HTTP/1.1 408 "), a[:200]
    # Meanwhile, and after, a well-behaved client is served.
    assert httpx.post(f"{url}/api/v1/ingest", json=payload(), timeout=10).status_code == 200


def test_concurrent_connections_are_capped(url: str) -> None:
    held = [_connect(url) for _ in range(30)]
    for s in held:  # each one starts a request and stalls in its body
        s.sendall(b"POST /api/v1/ingest HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n{")
    answers = [_answer(s) for s in held]
    statuses = [a.split(b" ", 2)[1] for a in answers]
    # Every connection was answered and closed; at most the cap got as far as its body.
    assert set(statuses) <= {b"408", b"503"} and statuses.count(b"408") <= 20, statuses
    assert statuses.count(b"503") >= 10, statuses
    assert httpx.get(f"{url}/api/v1/runs", timeout=10).status_code == 200
