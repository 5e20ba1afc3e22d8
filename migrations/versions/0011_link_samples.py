"""link_samples: per rank, batch and TCP connection, the link timing until it is analysed

The agent's ``comm`` section gains ``links`` (bytes each connection moved and the time it
was busy with data in flight, from the kernel's ``TCP_INFO``). The link detector joins the
two ends of each connection across ranks, so ingest stages these per (run, rank, batch's
last step, connection) and the analysis worker deletes them with the window's
``step_timings``.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "link_samples",
        sa.Column("run_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("local_ep", sa.BigInteger(), nullable=False),
        sa.Column("peer_ep", sa.BigInteger(), nullable=False),
        sa.Column("bytes_sent", sa.BigInteger(), nullable=False),
        sa.Column("bytes_received", sa.BigInteger(), nullable=False),
        sa.Column("busy_s", sa.Float(), nullable=False),
        sa.Column("steps", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_link_samples_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint(
            "run_id", "rank", "step", "local_ep", "peer_ep", name=op.f("pk_link_samples")
        ),
    )


def downgrade() -> None:
    op.drop_table("link_samples")
