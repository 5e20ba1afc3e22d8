"""job_steps keeps half of each page free: its rows are merged in place

Every group of batches merges into the same ``job_steps`` rows (one per step). Written
as an UPDATE into a page with free space, such a merge is a HOT update (no new index
entry) and PostgreSQL prunes the page's old versions as it reads it, so the table stays
near its nominal size without a VACUUM (``storage/postgres.py``). The setting applies to
pages written from now on; SQLite has no such setting and needs none (it rewrites a row
in place).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = ("job_steps",)
FILLFACTOR = 50


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for table in TABLES:
            op.execute(f"ALTER TABLE {table} SET (fillfactor = {FILLFACTOR})")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for table in TABLES:
            op.execute(f"ALTER TABLE {table} RESET (fillfactor)")
