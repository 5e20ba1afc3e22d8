"""window_summaries: the complete and profiled windows' census, computed once by the analysis

A scrape of a running job read every rank's row of the complete window (and of the newest
profiled one) to compute the quantiles across ranks again, each time the window moved:
2.2x the 1,024-rank scrape at 16,384 ranks. The analysis worker already reads those rows
when it analyses the window; it now stores what ``/metrics`` reports of them, one row per
run and kind, and the exporter reads that row.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "window_summaries",
        sa.Column("run_id", BigId, nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("window", sa.BigInteger(), nullable=False),
        sa.Column("steps", sa.BigInteger(), nullable=False),
        sa.Column("rank_steps", sa.BigInteger(), nullable=False),
        sa.Column("summary", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_window_summaries_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "kind", name=op.f("pk_window_summaries")),
    )


def downgrade() -> None:
    op.drop_table("window_summaries")
