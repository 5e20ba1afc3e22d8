"""Text the database cannot hold, refused at the edge.

PostgreSQL text cannot contain NUL (``\\x00``): a batch or a path carrying one would
reach the database and fail there (a 500). JSON can only carry a NUL escaped, as
``\\u0000``, so a body without that byte sequence needs no walk; one with it is walked
to name the field (the sequence may also be an escaped backslash followed by ``u0000``,
which is harmless and found nowhere).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Path
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel

from stepwatch.wire import RUN_NAME_PATTERN

#: A ``{run}`` path parameter: only what a run name can be (so never a NUL), else 422.
RunPath = Annotated[str, Path(pattern=RUN_NAME_PATTERN, description="the run's name")]


def refuse_nul(body: bytes, payload: BaseModel) -> None:
    """Raise a 422 naming the first field of ``payload`` whose text holds a NUL."""
    if b"\\u0000" not in body:
        return
    loc = _find_nul(payload.model_dump(), ())
    if loc is not None:
        raise RequestValidationError(
            [{"loc": loc, "msg": "text must not contain a NUL character (\\u0000)", "type": "nul"}]
        )


def _find_nul(value: Any, loc: tuple[str | int, ...]) -> tuple[str | int, ...] | None:
    if isinstance(value, str):
        return loc if "\x00" in value else None
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and "\x00" in key:
                return (*loc, key)
            found = _find_nul(item, (*loc, key))
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, (str, dict, list)):
                found = _find_nul(item, (*loc, i))
                if found is not None:
                    return found
    return None
