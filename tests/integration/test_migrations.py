"""Migrations: empty -> head -> base on both backends, and the models match head."""

from __future__ import annotations

import math

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Engine, inspect, select, text

from stepwatch_server.storage import migrate, packed
from stepwatch_server.storage.engine import make_engine
from stepwatch_server.storage.models import Base, StepTiming

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


def test_staged_timing_is_carried_over_packed_and_back(empty_db_url: str) -> None:
    """Migration 0021 packs the rows per step staged before it into rows of a rank's
    consecutive steps, and its downgrade gives back the same rows per step, NULLs and
    every float bit included."""
    migrate.upgrade(empty_db_url, "0020")
    engine = make_engine(empty_db_url)
    cols = ("step_time_s", "data_wait_s", "sync_s", "cpu_s", "runq_s")
    rows = [
        # run 1, rank 0: steps 1-3 and 7-8 (a gap); rank 1: step 2 alone; run 2, rank 0: 5-6
        (1, 0, 1, 0.1, 0.0, None, 0.25, 1e-9),
        (1, 0, 2, 0.1 + 0.2, 1e-300, 0.5, None, None),
        (1, 0, 3, 3.0, 0.0, 0.0, 0.0, 0.0),
        (1, 0, 7, 7.0, 0.5, 1.5, 2.5, None),
        (1, 0, 8, 8.0, 0.5, None, None, None),
        (1, 1, 2, 2.0, 0.0, 0.125, 0.25, 0.375),
        (2, 0, 5, 5.0, 0.0, None, 1.0, None),
        (2, 0, 6, 6.0, 0.0, 2.0, None, 0.5),
    ]
    names = ("run_id", "rank", "step", *cols)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(f"INSERT INTO step_timings ({', '.join(names)}) VALUES (:{', :'.join(names)})"),
                [dict(zip(names, r, strict=True)) for r in rows],
            )
        migrate.upgrade(empty_db_url)
        with engine.connect() as conn:
            got = conn.execute(
                select(StepTiming.__table__).order_by(
                    StepTiming.run_id, StepTiming.rank, StepTiming.first_step
                )
            ).all()
        assert [(r.run_id, r.rank, r.first_step, r.last_step) for r in got] == [
            (1, 0, 1, 3),
            (1, 0, 7, 8),
            (1, 1, 2, 2),
            (2, 0, 5, 6),
        ]
        unpacked = [
            (r.run_id, r.rank, r.first_step + j, *(None if math.isnan(v) else v for v in values))
            for r in got
            for j, values in enumerate(
                zip(*(packed.unpack(getattr(r, c)).tolist() for c in cols), strict=True)
            )
        ]
        assert unpacked == rows
        migrate.downgrade(empty_db_url, "0020")
        with engine.connect() as conn:
            back = conn.execute(
                text(f"SELECT {', '.join(names)} FROM step_timings ORDER BY run_id, rank, step")
            ).all()
        assert [tuple(r) for r in back] == rows
    finally:
        engine.dispose()


def _profiled_index(engine: Engine) -> str:
    """The SQL of ``rank_windows``' profiled index as the database holds it."""
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            sql = "SELECT sql FROM sqlite_master WHERE name = 'ix_rank_windows_profiled'"
        else:
            sql = "SELECT indexdef FROM pg_indexes WHERE indexname = 'ix_rank_windows_profiled'"
        return str(conn.execute(text(sql)).scalar_one())


def test_rebuilding_rank_windows_keeps_its_profiled_index_ordered_by_compute(empty_db_url: str) -> None:
    """Migration 0022 rebuilds ``rank_windows`` on SQLite (batch mode), whose reflected
    indexes lose their sort order: the profiled index keeps ``compute_s DESC`` (0014: the
    top-K read of ``/metrics`` takes its first K entries) both ways."""
    engine = make_engine(empty_db_url)
    try:
        for revision in ("0021", "head"):
            migrate.upgrade(empty_db_url, revision)
            assert "compute_s DESC" in _profiled_index(engine), revision
        migrate.downgrade(empty_db_url, "0021")
        assert "compute_s DESC" in _profiled_index(engine)
    finally:
        engine.dispose()
