"""Text the database cannot hold, refused at the edge.

PostgreSQL text cannot contain NUL (``\\x00``): a batch or a path carrying one would
reach the database and fail there (a 500). JSON can only carry a NUL escaped, as
``\\u0000``, so a body without that byte sequence needs no walk; one with it is walked
to name the field (the sequence may also be an escaped backslash followed by ``u0000``,
which is harmless and found nowhere).

Every batch is scanned, so the scan looks for a backslash first: a one-byte search runs
at ``memchr``'s speed (0.8 µs over a 30 KB host batch here), while the six-byte sequence
took 26-30 µs there (CPython's search slows on bodies full of the needle's last byte,
``0``), about a tenth of the web tier's cost per POST. The agent's bodies hold no
backslash unless a string needed escaping.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Path
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel

from stepwatch.wire import RUN_NAME_PATTERN

#: A ``{run}`` path parameter: only what a run name can be (so never a NUL), else 422.
RunPath = Annotated[str, Path(pattern=RUN_NAME_PATTERN, description="the run's name")]


def may_hold_nul(body: bytes) -> bool:
    """Whether a JSON ``body`` may carry a NUL in a string (False: it carries none)."""
    return b"\\" in body and b"\\u0000" in body


def refuse_nul(body: bytes, payload: BaseModel) -> None:
    """Raise a 422 naming the first field of ``payload`` whose text holds a NUL."""
    if not may_hold_nul(body):
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
