"""Alembic environment: runs migrations with the URL set by stepwatch_server.storage.migrate."""

from __future__ import annotations

from alembic import context
from sqlalchemy import pool

from stepwatch_server.storage.engine import make_engine
from stepwatch_server.storage.models import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_offline() -> None:
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    url = config.get_main_option("sqlalchemy.url")
    assert url is not None, "sqlalchemy.url must be set by stepwatch_server.storage.migrate"
    engine = make_engine(url, poolclass=pool.NullPool)
    with engine.connect() as connection:
        # render_as_batch: SQLite cannot ALTER most things; batch mode copies the table.
        context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
