"""ranks.profiles_through: how far a rank's profiler entries have been stored

The agent's profiler window is parsed on its own thread and its entry often rides on the
batch after the one that carries its steps. The analysis compared a window's ranks as
soon as their steps were in, so a profiled window was often compared without its compute
times: a compute straggler flag then neither advanced nor cleared there (the demo ended
with its flag open when it ran slowly). The agent now says, per batch, through which step
every profiler window has been sent; the analysis waits for that (or for the grace).
Nullable: rows written before it and ranks that send none (no profiler, an older agent)
are read as "nothing to wait for".

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("ranks", schema=None) as batch_op:
        batch_op.add_column(sa.Column("profiles_through", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ranks", schema=None) as batch_op:
        batch_op.drop_column("profiles_through")
