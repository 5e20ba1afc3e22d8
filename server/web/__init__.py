"""The built-in web page: server-rendered HTML (Jinja2) plus a vendored chart library.

Nothing is built at install time: the templates and the static files (uPlot from npm,
with its license, and a small script of our own) ship inside the package. ``install``
adds the pages and ``/static`` to an app made by the factory.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from .routes import router

STATIC_DIR = Path(__file__).parent / "static"


def install(app: FastAPI, dependencies: Sequence[Any] = ()) -> None:
    app.include_router(router, dependencies=list(dependencies))
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")


__all__ = ["STATIC_DIR", "install"]
