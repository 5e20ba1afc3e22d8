"""metrics read indexes

/metrics reads, per scrape, every rank's row of one or two recent windows of a run and
the run's newest profiled window. The primary key (run_id, rank, window) cannot serve
either without scanning all windows of the run, so: an index on (run_id, window), and a
partial one over the rows that carry a profiler breakdown.

Revision ID: 0007
Revises: 0003
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

PROFILED = sa.text("profiled_steps IS NOT NULL")


def upgrade() -> None:
    with op.batch_alter_table("rank_windows", schema=None) as batch_op:
        batch_op.create_index(
            "ix_rank_windows_profiled",
            ["run_id", "window"],
            unique=False,
            postgresql_where=PROFILED,
            sqlite_where=PROFILED,
        )
        batch_op.create_index(batch_op.f("ix_rank_windows_run_id_window"), ["run_id", "window"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("rank_windows", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_rank_windows_run_id_window"))
        batch_op.drop_index("ix_rank_windows_profiled", postgresql_where=PROFILED, sqlite_where=PROFILED)
