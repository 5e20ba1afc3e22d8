"""step_timings.runq_s: the training thread's run-queue wait beside its CPU time

A rank late at the collectives with no extra CPU was named a host stall; on a busy host
it may only have waited for a core (runnable, not running), which the late-arrival
detector now tells apart. The agent reads the wait once per window (Linux schedstat);
ingest stages it per step as the window's mean. Nullable: older agents, other systems.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("step_timings", schema=None) as batch_op:
        batch_op.add_column(sa.Column("runq_s", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("step_timings", schema=None) as batch_op:
        batch_op.drop_column("runq_s")
