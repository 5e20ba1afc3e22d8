"""runs.window_provisional: a run's window size waits for a batch that shows its pace

A run's window size was chosen from its first batch, which is often a heartbeat (no step
yet) or the first step alone (compilation, the first bucket rebuild: longer than the send
interval). Both gave windows of one step for the whole run. The size now stays a
placeholder, flagged here, until a batch times a later step; every window size puts
step 1 in window 0, so nothing stored before depends on the placeholder.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("window_provisional", sa.Boolean(), server_default=sa.false(), nullable=False)
        )


def downgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_column("window_provisional")
