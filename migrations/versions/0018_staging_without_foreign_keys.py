"""step_timings, link_samples: no foreign key to runs

Both stage a DDP job's timing until the analysis worker has read and deleted it: one row
per rank and step, and per connection and window, so with the collective timing on (the
default for a DDP model) they take most of ingest's rows. A foreign key checks every
inserted row against ``runs`` (a trigger and a row lock per row): COPY of such rows was
three times slower with it (110-135k against 350-430k rows/s), and the collector's
PostgreSQL time per 64-step window fell from 769 to 513 us without it. Ingest writes
these rows only for a run it has just admitted or found, in the transaction that claims
the batch, so the key cannot dangle; a run removed by hand leaves its staged rows, which
nothing reads.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

STAGING = ("step_timings", "link_samples")


def upgrade() -> None:
    for table in STAGING:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_constraint(op.f(f"fk_{table}_run_id_runs"), type_="foreignkey")


def downgrade() -> None:
    for table in STAGING:
        # Rows of a run removed by hand since the upgrade would fail the key.
        op.execute(f"DELETE FROM {table} WHERE run_id NOT IN (SELECT id FROM runs)")
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.create_foreign_key(
                op.f(f"fk_{table}_run_id_runs"), "runs", ["run_id"], ["id"], ondelete="CASCADE"
            )
