"""Shared fixtures: a real database of each backend, migrated to head."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

from stepwatch_server.storage import migrate
from stepwatch_server.storage.engine import make_engine

from . import pg

BACKENDS = ["sqlite", "postgresql"]


@pytest.fixture(scope="session")
def pg_admin() -> Iterator[str]:
    try:
        with pg.admin_url() as url:
            yield url
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(params=BACKENDS)
def empty_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty database on each backend (not migrated)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'stepwatch.db'}"
        return
    admin: str = request.getfixturevalue("pg_admin")
    with pg.fresh_database(admin) as url:
        yield url


@pytest.fixture
def db_url(empty_db_url: str) -> str:
    """A fresh database on each backend, migrated to head."""
    migrate.upgrade(empty_db_url)
    return empty_db_url


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    eng = make_engine(db_url)
    yield eng
    eng.dispose()
