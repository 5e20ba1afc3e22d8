"""Server-side bounds on connections: a deadline for reading each request (its headers and
its body) and a cap on concurrent connections.

uvicorn times out idle keep-alive connections but not a request in progress: a client
that sends half its headers, or a Content-Length larger than its body, held its
connection (and a file descriptor) as long as it liked. :class:`DeadlineProtocol` arms a
timer when a connection opens and when each request begins, and disarms it once the
request has been read whole; if it fires first, the client gets ``408`` and the
connection is closed. The cap is uvicorn's ``limit_concurrency``: past it, new
requests are answered ``503`` at once instead of queueing without bound.

The deadline is bound into the protocol factory from the ``Settings`` the server is started
with (a ``functools.partial``, which pickles into uvicorn's spawned workers). It was once
read from the environment and cached per process: a test that set a 1 s deadline left it
cached for every later server in that process, and a loaded collector then answered 408
(and reset) requests whose body came a second after their headers.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ..settings import Settings

_BODY = b'{"detail": "request not received within the deadline"}'
_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: " + str(len(_BODY)).encode() + b"\r\n\r\n" + _BODY
)


class DeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline for reading each request."""

    def __init__(self, *args: Any, read_deadline_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline_s = read_deadline_s
        self._read_timer: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(self._deadline_s, self._read_timeout)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def _read_timeout(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is None or not cycle.response_started:
            self.transport.write(_TIMEOUT)
        if cycle is not None:
            cycle.disconnected = True  # the app's receive() answers http.disconnect
            cycle.message_event.set()
        self.transport.close()


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """The connection bounds as ``uvicorn.Config`` keyword arguments."""
    return {
        "http": functools.partial(DeadlineProtocol, read_deadline_s=settings.request_read_timeout_s),
        "limit_concurrency": settings.max_connections,
        "timeout_keep_alive": settings.keep_alive_timeout_s,
    }
