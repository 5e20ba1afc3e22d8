"""directives, directive_acks: the collector steers its agents (issue 12)

Captures (the same steps profiled on a flagged rank and its peers) and live settings are
delivered in the answers to the ranks' own batches and acknowledged in their next ones;
these two tables hold what was asked, of whom, and what each rank answered;
``capture_traces`` the gzipped raw trace a capture's subject rank uploads when asked.
``ranks.send_interval_s``: each rank's send interval in force, how far ahead a capture
must start for every selected rank to take it.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    with op.batch_alter_table("ranks", schema=None) as batch_op:
        batch_op.add_column(sa.Column("send_interval_s", sa.Float(), nullable=True))
    op.create_table(
        "directives",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("run_id", BigId, nullable=False),
        sa.Column("kind", sa.String(length=8), nullable=False),
        sa.Column("ranks", sa.JSON(), nullable=True),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("reason", sa.String(length=256), nullable=False),
        sa.Column("event_id", sa.BigInteger(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("result", sa.JSON(), nullable=True),
        sa.Column("done_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_directives_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_directives")),
    )
    op.create_index(op.f("ix_directives_run_id_expires_at"), "directives", ["run_id", "expires_at"])
    op.create_table(
        "directive_acks",
        sa.Column("directive_id", BigId, nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.String(length=200), nullable=True),
        sa.Column("settings", sa.JSON(), nullable=True),
        sa.Column("first_step", sa.BigInteger(), nullable=True),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["directive_id"],
            ["directives.id"],
            name=op.f("fk_directive_acks_directive_id_directives"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("directive_id", "rank", name=op.f("pk_directive_acks")),
    )
    op.create_table(
        "capture_traces",
        sa.Column("directive_id", BigId, nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["directive_id"],
            ["directives.id"],
            name=op.f("fk_capture_traces_directive_id_directives"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("directive_id", "rank", name=op.f("pk_capture_traces")),
    )
    op.create_index(op.f("ix_capture_traces_created_at"), "capture_traces", ["created_at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_capture_traces_created_at"), table_name="capture_traces")
    op.drop_table("capture_traces")
    op.drop_table("directive_acks")
    op.drop_index(op.f("ix_directives_run_id_expires_at"), table_name="directives")
    op.drop_table("directives")
    with op.batch_alter_table("ranks", schema=None) as batch_op:
        batch_op.drop_column("send_interval_s")
