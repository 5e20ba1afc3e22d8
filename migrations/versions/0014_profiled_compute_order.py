"""profiled rows ordered by compute time

/metrics picks a run's top-K slowest ranks by compute time in its newest profiled
window (largest first, ties to the lower rank). The partial index over the profiled rows
was keyed (run_id, window) only, so that was a top-N sort over every rank's row of the
window (16,384 at the largest run measured); keyed (run_id, window, compute_s DESC,
rank) it is the index's first K entries. The same index still serves the profiled
window's census and the newest profiled window (its key prefix), and the profile writer
already updated it (the rows enter it when their breakdown is written).

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

PROFILED = sa.text("profiled_steps IS NOT NULL")


def upgrade() -> None:
    with op.batch_alter_table("rank_windows", schema=None) as batch_op:
        batch_op.drop_index("ix_rank_windows_profiled", postgresql_where=PROFILED, sqlite_where=PROFILED)
        batch_op.create_index(
            "ix_rank_windows_profiled",
            ["run_id", "window", sa.desc(sa.column("compute_s")), "rank"],
            unique=False,
            postgresql_where=PROFILED,
            sqlite_where=PROFILED,
        )


def downgrade() -> None:
    with op.batch_alter_table("rank_windows", schema=None) as batch_op:
        batch_op.drop_index("ix_rank_windows_profiled", postgresql_where=PROFILED, sqlite_where=PROFILED)
        batch_op.create_index(
            "ix_rank_windows_profiled",
            ["run_id", "window"],
            unique=False,
            postgresql_where=PROFILED,
            sqlite_where=PROFILED,
        )
