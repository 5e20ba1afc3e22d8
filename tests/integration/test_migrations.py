"""Migrations: empty -> head -> base on both backends, and the models match head."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from stepwatch_server.storage import migrate
from stepwatch_server.storage.engine import make_engine
from stepwatch_server.storage.models import Base

TABLES = {
    "runs",
    "ranks",
    "rank_windows",
    "job_steps",
    "ingested_batches",
    "profile_windows",
    "collective_stats",
    "profile_pending",
    "profile_arrivals",
    "step_timings",
    "job_step_buckets",
}


def test_upgrade_to_head_then_back_to_base(empty_db_url: str) -> None:
    engine = make_engine(empty_db_url)
    try:
        migrate.upgrade(empty_db_url)
        assert migrate.current_revision(engine) == migrate.head_revision()
        assert set(inspect(engine).get_table_names()) >= TABLES
        migrate.downgrade(empty_db_url, "base")
        assert migrate.current_revision(engine) is None
        assert not TABLES & set(inspect(engine).get_table_names())
        migrate.upgrade(empty_db_url)  # and up again: downgrades left nothing behind
        assert migrate.current_revision(engine) == migrate.head_revision()
    finally:
        engine.dispose()


def test_models_match_migrations(db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            diff = compare_metadata(ctx, Base.metadata)
        assert diff == [], f"models and migrations differ; generate a migration: {diff}"
    finally:
        engine.dispose()


def test_packaged_script_location_is_the_migrations_folder() -> None:
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    assert Path(migrate.SCRIPT_LOCATION) == root / "migrations"
