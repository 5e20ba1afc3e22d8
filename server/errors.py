"""The collector's errors: each carries the HTTP status it answers with.

Raised anywhere (reads, auth, ingest admission) without importing the web framework;
``api/errors.py`` turns every :class:`CollectorError` into its answer in one handler.
"""

from __future__ import annotations

from collections.abc import Mapping


class CollectorError(Exception):
    """A failure the client should see: ``status`` and ``str(self)`` as ``detail``."""

    status = 500

    def __init__(self, detail: str, *, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(detail)
        self.headers = dict(headers or {})


class NotFoundError(CollectorError, LookupError):
    """The named run (or metric) does not exist."""

    status = 404


class UnauthorizedError(CollectorError):
    """No token, or one this collector does not know."""

    status = 401


class ForbiddenError(CollectorError):
    """A token that may not do this (scope, run quota, another token's run)."""

    status = 403


class ConflictError(CollectorError):
    """A batch that contradicts the stored run (another world size)."""

    status = 409
