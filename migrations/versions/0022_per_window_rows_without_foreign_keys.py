"""ingested_batches, rank_windows: no foreign key to runs

Every rank-window inserts one row into each (its batch id, its window's sums): with a
foreign key, PostgreSQL ran a trigger per inserted row that looks the run up and locks
its row (``FOR KEY SHARE``), two per rank-window. In the ingest benchmark
(``pg_stat_statements`` over 16,384 rank-windows posted per host) the two inserts took
14-15 and 10-11 us of the server's time per rank-window with the keys, 7.5-8 and 5.7-6.8
without them, and the lookups 3.3-3.6 us more: about a quarter of PostgreSQL's time per
rank-window. It matters beyond its share: the group commits of the collector's web
workers take the job-step bucket locks first and so write one after another
(``ingest/store.py``), and the throughput of ingest is the rank-windows of a group over
the time its transaction holds those locks.

As for the staged timing (0018): ingest writes these rows only for a run it has just
admitted or found, in the transaction that claims the batch, and stepwatch never deletes
a run, so the key cannot dangle. A run removed by hand leaves these rows behind: remove
them with it (on SQLite a new run may be given a removed run's id, and would merge its
windows into them). ``ranks`` keeps its key: a rank's row is inserted once per run and
updated after, where a key is not checked.

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0022"
down_revision: str | None = "0021"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

PER_WINDOW = ("ingested_batches", "rank_windows")
PROFILED = sa.text("profiled_steps IS NOT NULL")


def _keep_profiled_order(table: str) -> None:
    """SQLite rebuilds the table in batch mode, its indexes from reflection, which loses
    ``compute_s DESC`` of ``rank_windows``' profiled index (0014: the top-K read of
    ``/metrics`` is its first K entries): made again after the rebuild, as 0014 made it
    (a batch of index changes alone alters the table in place)."""
    if table != "rank_windows" or op.get_bind().dialect.name != "sqlite":
        return
    with op.batch_alter_table("rank_windows", schema=None) as batch_op:
        batch_op.drop_index("ix_rank_windows_profiled", sqlite_where=PROFILED)
        batch_op.create_index(
            "ix_rank_windows_profiled",
            ["run_id", "window", sa.desc(sa.column("compute_s")), "rank"],
            unique=False,
            sqlite_where=PROFILED,
        )


def upgrade() -> None:
    for table in PER_WINDOW:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_constraint(op.f(f"fk_{table}_run_id_runs"), type_="foreignkey")
        _keep_profiled_order(table)


def downgrade() -> None:
    for table in PER_WINDOW:
        # Rows of a run removed by hand since the upgrade would fail the key.
        op.execute(f"DELETE FROM {table} WHERE run_id NOT IN (SELECT id FROM runs)")
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.create_foreign_key(
                op.f(f"fk_{table}_run_id_runs"), "runs", ["run_id"], ["id"], ondelete="CASCADE"
            )
        _keep_profiled_order(table)
