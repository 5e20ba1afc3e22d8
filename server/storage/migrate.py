"""Alembic, driven from code: ``stepwatch db upgrade``, ``serve`` start and tests.

The migration scripts live in the top-level ``migrations/`` folder, which the build maps
to ``stepwatch_server.migrations`` so that an installed wheel carries them.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

import stepwatch_server.migrations as _migrations

from .engine import normalise_url

SCRIPT_LOCATION = str(Path(_migrations.__file__).resolve().parent)


def alembic_config(database_url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", SCRIPT_LOCATION)
    # ConfigParser interpolation: a literal % in a password must be doubled.
    cfg.set_main_option("sqlalchemy.url", normalise_url(database_url).replace("%", "%%"))
    return cfg


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(database_url), revision)


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def current_revision_for_url(database_url: str) -> str | None:
    from .engine import make_engine

    engine = make_engine(database_url)
    try:
        return current_revision(engine)
    finally:
        engine.dispose()
