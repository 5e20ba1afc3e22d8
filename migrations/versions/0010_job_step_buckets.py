"""job_step_buckets: job steps rolled up per run into buckets of 64 steps

The overview and the series scanned every ``job_steps`` row of a run (223 ms and up to
522 ms at 30 days of a 4,096-rank run). Ingest now keeps ``job_step_buckets`` up to date
(``storage/rollups.py``); this revision creates the table and fills it from the steps
already stored, with the same generated statement ingest uses.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql, sqlite

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_VALUES = ("step_time", "slowest", "data_wait", "tokens_per_s", "ranks")
#: The columns this revision creates (the backfill fills exactly these).
COLUMNS: tuple[tuple[str, Any, bool], ...] = (
    ("n_steps", sa.Integer(), False),
    ("first_step", sa.BigInteger(), False),
    ("last_step", sa.BigInteger(), False),
    *((f"{v}_{p}", sa.Float(), False) for v in _VALUES for p in ("sum", "min", "max")),
    ("tokens_est", sa.Float(), False),
    ("tokens", sa.Float(), False),
    ("padded_tokens", sa.Float(), True),
    ("untagged_steps", sa.Integer(), False),
    ("untagged_step_time", sa.Float(), False),
    ("untagged_tokens_est", sa.Float(), False),
    ("untagged_data_wait", sa.Float(), False),
)


def upgrade() -> None:
    op.create_table(
        "job_step_buckets",
        sa.Column("run_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("bucket", sa.BigInteger(), nullable=False),
        *(sa.Column(name, kind, nullable=nullable) for name, kind, nullable in COLUMNS),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_job_step_buckets_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "bucket", name=op.f("pk_job_step_buckets")),
    )
    from stepwatch_server.storage import rollups

    bind = op.get_bind()
    insert = postgresql.insert if bind.dialect.name == "postgresql" else sqlite.insert
    rollups.rebuild(bind, insert, only=[name for name, _, _ in COLUMNS])


def downgrade() -> None:
    op.drop_table("job_step_buckets")
