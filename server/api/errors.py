"""One place that turns failures into HTTP answers.

- Validation errors: 422 whose ``detail`` names every offending field
  (``steps.tokens.3: Input should be greater than or equal to 0``).
- The collector's own errors (``stepwatch_server.errors``): their status (401, 403,
  404) and message.
- Database unreachable: 503 with ``Retry-After`` (the agent backs off and keeps its
  buffer), never a 500 that would look like a bug in the batch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from ..errors import CollectorError

log = logging.getLogger("stepwatch_server")
RETRY_AFTER_S = 5


def _loc(loc: Sequence[Any]) -> str:
    parts = [str(p) for p in loc if p not in ("body",)]
    return ".".join(parts) or "body"


def describe(errors: Sequence[Any]) -> str:
    return "; ".join(f"{_loc(e.get('loc', ()))}: {e.get('msg', 'invalid')}" for e in errors[:20])


def _clean(errors: Sequence[Any]) -> list[dict[str, Any]]:
    # The offending input can be large (a 10,000-element array): echo only where and why.
    return [{"loc": list(e.get("loc", ())), "msg": e.get("msg"), "type": e.get("type")} for e in errors[:100]]


def install(app: FastAPI, *, retry_after_s: int = RETRY_AFTER_S) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        return JSONResponse(
            status_code=422,
            content={"detail": f"invalid request: {describe(errors)}", "errors": _clean(errors)},
        )

    @app.exception_handler(CollectorError)
    async def _collector(_: Request, exc: CollectorError) -> JSONResponse:
        return JSONResponse(status_code=exc.status, content={"detail": str(exc)}, headers=exc.headers)

    async def _db_down(_: Request, exc: Exception) -> JSONResponse:
        log.warning("database unavailable: %s", exc.__class__.__name__)
        return JSONResponse(
            status_code=503,
            content={"detail": "database unavailable; retry later"},
            headers={"Retry-After": str(retry_after_s)},
        )

    async def _dbapi(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, DBAPIError) and exc.connection_invalidated:
            return await _db_down(request, exc)
        log.exception("database error", exc_info=exc)
        return JSONResponse(status_code=500, content={"detail": "internal database error"})

    app.add_exception_handler(OperationalError, _db_down)
    app.add_exception_handler(PoolTimeout, _db_down)
    app.add_exception_handler(DBAPIError, _dbapi)
