"""rank_groups: each rank's latest collective counters per process group

The agent's ``comm.groups`` (collectives entered and completed per process group, the
op and entry time of the one in flight) was validated and dropped. The hang detector
needs them to say which rank never entered which collective, so ingest keeps each
rank's latest per (run, rank, group).

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "rank_groups",
        sa.Column("run_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("group_name", sa.String(length=128), nullable=False),
        sa.Column("entered", sa.BigInteger(), nullable=False),
        sa.Column("completed", sa.BigInteger(), nullable=False),
        sa.Column("op", sa.String(length=16), nullable=True),
        sa.Column("since", sa.Float(), nullable=True),
        sa.Column("sampled_at", sa.Float(), nullable=False),
        sa.Column("heartbeat", sa.SmallInteger(), nullable=False),
        sa.Column("idle_s", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_rank_groups_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "rank", "group_name", name=op.f("pk_rank_groups")),
    )


def downgrade() -> None:
    op.drop_table("rank_groups")
