"""``POST /api/v1/ingest`` (and its per-host form ``/ingest/batches``) served beside
FastAPI's routing, not through it.

Every rank of a job posts every window, so this one route carries nearly all of the
collector's requests. Through FastAPI each paid the middleware chain (error, telemetry
and body-limit layers, the exception middleware, the exit stack) and the dependency
solver: about 340 µs of CPU per POST on the shared 2-core machine, more than validating
and storing the batch. :class:`IngestPath` answers the same requests with the same code:
the body limit (``limits.BodyLimit``), the bearer check (``auth``), the route function
itself (``routes.ingest``: validation, limits, admission, group commit) and the app's own
exception handlers (``errors.install``) for every failure, so answers, 4xx messages and
durability are those of the declared route, which stays in the OpenAPI document.
"""

from __future__ import annotations

import logging

from starlette.requests import ClientDisconnect, Request
from starlette.responses import PlainTextResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from .auth import authenticator, bearer
from .limits import BodyLimit, BodyTooLargeError
from .routes import HOST_BATCH_PATH, INGEST_PATH, ingest, ingest_batches

log = logging.getLogger("stepwatch_server")


#: The route function of each path :class:`IngestPath` answers (the declared routes').
ROUTES = {INGEST_PATH: ingest, HOST_BATCH_PATH: ingest_batches}


def is_ingest(scope: Scope) -> bool:
    """The requests :class:`IngestPath` answers."""
    return bool(scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in ROUTES)


class IngestPath:
    """The ingest route as a plain ASGI app over the collector's ``app`` (its state and
    exception handlers), inside the collector's body limit."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self._limited = BodyLimit(self._answer, max_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope["app"] = self.app  # what ``request.app`` reads, as Starlette sets it
        await self._limited(scope, receive, send)

    async def _answer(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        response: Response
        try:
            request.state.token = authenticator(request).check(await bearer(request), "write")
            result = await ROUTES[scope["path"]](request)
            response = Response(result.model_dump_json(exclude_none=True), media_type="application/json")
        except BodyTooLargeError:
            raise  # answered 413 by the body limit
        except ClientDisconnect:
            return  # gone, or timed out reading (``timeouts``: 408 already written): no one to answer
        except Exception as exc:  # answered as the app answers it anywhere else
            response = await self._handled(request, exc)
        await response(scope, receive, send)

    async def _handled(self, request: Request, exc: Exception) -> Response:
        handlers = getattr(self.app, "exception_handlers", {})
        for cls in type(exc).__mro__:
            handler = handlers.get(cls)
            if handler is not None:
                answer: Response = await handler(request, exc)
                return answer
        log.error("ingest failed", exc_info=exc)
        return PlainTextResponse("Internal Server Error", status_code=500)
