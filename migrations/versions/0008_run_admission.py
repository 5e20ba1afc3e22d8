"""run admission: a quota counter per token, batch ids scoped by run; runs.last_report_at

Runs per token were counted with COUNT(*) over the token's runs and checked before the
run was created, so concurrent first batches of new runs all passed the check. The
counter row (``token_quotas``) is taken under its row lock in the transaction that
creates the run. Batch ids were one global key, so a writer who knew another run's batch
id could make that batch answer ``stored: false``: they are now unique per run.
``runs.last_report_at`` (collector clock, indexed) lets ``/metrics`` pick the runs it
exports with one index range instead of probing every run's batches.

Revision ID: 0008
Revises: 0006
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "token_quotas",
        sa.Column("token", sa.String(length=64), nullable=False),
        sa.Column("runs_created", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("token", name=op.f("pk_token_quotas")),
    )
    # The runs each token created so far ('' for writes without a token).
    op.execute(
        "INSERT INTO token_quotas (token, runs_created) "
        "SELECT coalesce(created_by, ''), count(*) FROM runs GROUP BY coalesce(created_by, '')"
    )
    with op.batch_alter_table("ingested_batches", schema=None) as batch_op:
        batch_op.drop_constraint("pk_ingested_batches", type_="primary")
        batch_op.create_primary_key("pk_ingested_batches", ["run_id", "batch_id"])
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("last_report_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.create_index(batch_op.f("ix_runs_last_report_at"), ["last_report_at"], unique=False)
    op.execute(
        "UPDATE runs SET last_report_at = "
        "(SELECT max(received_at) FROM ingested_batches WHERE ingested_batches.run_id = runs.id)"
    )


def downgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_runs_last_report_at"))
        batch_op.drop_column("last_report_at")
    # Ids that two runs share cannot both stay: keep one of each.
    op.execute(
        "DELETE FROM ingested_batches WHERE EXISTS (SELECT 1 FROM ingested_batches o "
        "WHERE o.batch_id = ingested_batches.batch_id AND o.run_id < ingested_batches.run_id)"
    )
    with op.batch_alter_table("ingested_batches", schema=None) as batch_op:
        batch_op.drop_constraint("pk_ingested_batches", type_="primary")
        batch_op.create_primary_key("pk_ingested_batches", ["batch_id"])
    op.drop_table("token_quotas")
