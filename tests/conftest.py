"""Shared fixtures: a real database of each backend, migrated to head; and pytest's log
capture made safe against threads that create loggers (end of file)."""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from _pytest import logging as _pytest_logging
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
def backend(request: pytest.FixtureRequest) -> str:
    """The database backend a test runs on: each such test runs on both."""
    return str(request.param)


@pytest.fixture
def empty_db_url(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty database on each backend (not migrated)."""
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'stepwatch.db'}"
        return
    admin: str = request.getfixturevalue("pg_admin")
    with pg.fresh_database(admin) as url:
        yield url


@pytest.fixture(scope="session")
def sqlite_at_head(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One SQLite file migrated to head per test session, copied for each test (a
    migration costs about 0.3 s; a copy, a millisecond)."""
    path = tmp_path_factory.mktemp("template") / "stepwatch.db"
    migrate.upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture(scope="session")
def pg_at_head(pg_admin: str) -> Iterator[str]:
    """One PostgreSQL database migrated to head per test session: the template that each
    test's database is created from (``CREATE DATABASE ... TEMPLATE``)."""
    with pg.fresh_database(pg_admin, prefix="stepwatch_head") as url:
        migrate.upgrade(url)
        yield url.rsplit("/", 1)[1]


@pytest.fixture
def db_url(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh database on each backend, migrated to head: a copy of the session's
    migrated one (``tests/integration/test_migrations.py`` runs the migrations themselves)."""
    if backend == "sqlite":
        template: Path = request.getfixturevalue("sqlite_at_head")
        path = tmp_path / "stepwatch.db"
        with closing(sqlite3.connect(template)) as src, closing(sqlite3.connect(path)) as dst:
            src.backup(dst)
        yield f"sqlite:///{path}"
        return
    admin: str = request.getfixturevalue("pg_admin")
    with pg.fresh_database(admin, template=request.getfixturevalue("pg_at_head")) as url:
        yield url


@pytest.fixture
def pg_engine(pg_admin: str, pg_at_head: str) -> Iterator[Engine]:
    """A fresh PostgreSQL database at head, for the tests of what only PostgreSQL does
    (locks between writers, row versions and their pruning); disposed after."""
    with pg.fresh_database(pg_admin, template=pg_at_head) as url:
        eng = make_engine(url)
        yield eng
        eng.dispose()


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    eng = make_engine(db_url)
    yield eng
    eng.dispose()


#: The longest tests of the parallel phase (tens of seconds each on 2 cores), longest first.
LONG_FIRST = (
    "tests/test_quality.py::test_mypy_strict_on_agent_and_server",
    "tests/integration/test_fuzz.py::",
    "tests/integration/test_admission.py::test_a_thousand_new_runs_at_once",
    "tests/integration/test_benchmarks.py::",
    "tests/e2e/test_evaluate.py::",
    "tests/e2e/test_replicas.py::",
    "tests/e2e/test_slurm.py::",
)


@pytest.hookimpl(trylast=True)  # after ``-m`` has deselected: the order of what runs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deal the longest tests out to the pytest-xdist workers, each at the front of what
    a worker gets first, so that none is left running several of them one after another
    at the end. Work stealing (``--dist worksteal``) first hands each of n workers one of
    n contiguous slices of this list, evenly, and lets an idle worker take only the tail
    of another's queue: long tests at the list's front would all go to the first worker."""

    def rank(item: pytest.Item) -> int:
        return next((i for i, p in enumerate(LONG_FIRST) if item.nodeid.startswith(p)), len(LONG_FIRST))

    items.sort(key=rank)  # stable: the rest keep their order
    workers = config.getoption("numprocesses", default=None)
    n_long = sum(1 for item in items if rank(item) < len(LONG_FIRST))
    if not isinstance(workers, int) or workers < 2 or n_long == 0:
        return
    long, rest = items[:n_long], items[n_long:]
    dealt: list[pytest.Item] = []
    for k in range(workers):
        mine = long[k::workers]
        size = (len(items) - len(dealt)) // (workers - k)  # the scheduler's even split
        take = max(0, size - len(mine))
        dealt += mine + rest[:take]
        rest = rest[take:]
    items[:] = dealt + rest


# -- pytest's log capture, made safe against threads that create loggers -----------------
# pytest's ``catching_logs.__enter__`` (each test's setup, call and teardown) iterates
# ``logging``'s logger dictionary without ``logging``'s lock. A thread that creates a logger
# at that moment (a module imported lazily by a background thread an earlier test left
# running) made it raise "dictionary changed size during iteration" at the setup or
# teardown of an unrelated test: twice in fresh CI runs, both times
# ``tests/unit/test_env.py::test_bad_layout_raises_at_init``. ``logging`` inserts new
# loggers under its module lock (re-entrant), so entering under it too closes the race.
# ``tests/unit/test_log_capture_race.py`` shows it.
_pytest_catching_logs_enter = _pytest_logging.catching_logs.__enter__


def _catching_logs_enter_under_logging_lock(self: Any) -> Any:
    with logging._lock:  # type: ignore[attr-defined]
        return _pytest_catching_logs_enter(self)


_pytest_logging.catching_logs.__enter__ = _catching_logs_enter_under_logging_lock  # type: ignore[method-assign]
