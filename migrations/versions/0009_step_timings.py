"""step_timings: per rank and step, the always-on collective timing until it is analysed

The agent's ``comm`` section (sync and training-thread CPU per step) was validated and
dropped. The late-arrival detectors pair ranks step by step, so ingest stages these
values per (run, rank, step) and the analysis worker deletes them once the step's window
is analysed.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "step_timings",
        sa.Column("run_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("step_time_s", sa.Float(), nullable=False),
        sa.Column("data_wait_s", sa.Float(), nullable=False),
        sa.Column("sync_s", sa.Float(), nullable=True),
        sa.Column("cpu_s", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_step_timings_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "rank", "step", name=op.f("pk_step_timings")),
    )


def downgrade() -> None:
    op.drop_table("step_timings")
