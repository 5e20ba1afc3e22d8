"""step_timings: one row per rank and batch, its steps packed, not one row per step

The staged collective timing was a row per rank and step: with the comm section on (the
default with a DDP model) most of ingest's rows, each inserted, indexed and deleted once
analysed. The collector's PostgreSQL spent 438 us per 64-step rank-window with it against
88 us with no staging at all (``python -m benchmarks.ingest``, per host). A batch's steps
are now one row, each column one float64 per step, little-endian, NaN where a row per step
held NULL (``storage/packed.py``); ``last_step`` bounds the reads and deletes. Two batches
carrying the same step are two rows (the key holds the agent's ``sent_at``), and the
reader gives the step to the later sent. Staged rows are carried over both ways: a
rank's consecutive steps become one row (``sent_at`` 0: rows per step never overlap).

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import groupby
from typing import Any

import numpy as np
import sqlalchemy as sa
from alembic import op

revision: str = "0021"
down_revision: str | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
VALUES = ("step_time_s", "data_wait_s", "sync_s", "cpu_s", "runq_s")
NULLABLE = frozenset({"sync_s", "cpu_s", "runq_s"})
#: Packed format as of this revision (``storage/packed.py``), frozen here.
DTYPE = np.dtype("<f8")
CHUNK = 1000


def _rows_table(name: str) -> sa.TableClause:
    return sa.table(
        name,
        sa.column("run_id", sa.BigInteger()),
        sa.column("rank", sa.Integer()),
        sa.column("step", sa.BigInteger()),
        *(sa.column(v, sa.Float()) for v in VALUES),
    )


def _packed_table(name: str) -> sa.TableClause:
    return sa.table(
        name,
        sa.column("run_id", sa.BigInteger()),
        sa.column("rank", sa.Integer()),
        sa.column("first_step", sa.BigInteger()),
        sa.column("last_step", sa.BigInteger()),
        sa.column("sent_at", sa.Float()),
        *(sa.column(v, sa.LargeBinary()) for v in VALUES),
    )


def _aside(old: str, new: str) -> None:
    """Rename a table out of the way (on PostgreSQL its primary key's index too, whose
    name the new table's takes)."""
    op.rename_table(old, new)
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"ALTER TABLE {new} RENAME CONSTRAINT pk_{old} TO pk_{new}")


def _inserted(table: sa.TableClause, rows: Iterator[dict[str, Any]]) -> None:
    bind = op.get_bind()
    chunk: list[dict[str, Any]] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == CHUNK:
            bind.execute(table.insert(), chunk)
            chunk = []
    if chunk:
        bind.execute(table.insert(), chunk)


def _packed_rows() -> Iterator[dict[str, Any]]:
    """The rows per step as rows per run of a rank's consecutive steps."""
    t = _rows_table("step_timings_rows")
    result = op.get_bind().execute(sa.select(t).order_by(t.c.run_id, t.c.rank, t.c.step))
    for (run_id, rank), rows in groupby(result, key=lambda r: (r.run_id, r.rank)):
        steps = list(rows)
        start = 0
        for i in range(1, len(steps) + 1):
            if i == len(steps) or steps[i].step != steps[i - 1].step + 1:
                span = steps[start:i]
                yield {
                    "run_id": run_id,
                    "rank": rank,
                    "first_step": span[0].step,
                    "last_step": span[-1].step,
                    "sent_at": 0.0,
                    **{
                        v: np.array(
                            [np.nan if getattr(r, v) is None else getattr(r, v) for r in span], dtype=DTYPE
                        ).tobytes()
                        for v in VALUES
                    },
                }
                start = i


def _step_rows(name: str) -> Iterator[dict[str, Any]]:
    """Packed rows back as rows per step (a step two rows carry: the later sent)."""
    t = _packed_table(name)
    result = op.get_bind().execute(sa.select(t).order_by(t.c.run_id, t.c.rank, t.c.sent_at, t.c.first_step))
    for (run_id, rank), rows in groupby(result, key=lambda r: (r.run_id, r.rank)):
        steps: dict[int, dict[str, Any]] = {}
        for r in rows:
            cols = {v: np.frombuffer(getattr(r, v), dtype=DTYPE).tolist() for v in VALUES}
            for j in range(r.last_step - r.first_step + 1):
                steps[r.first_step + j] = {
                    v: None if v in NULLABLE and cols[v][j] != cols[v][j] else cols[v][j] for v in VALUES
                }
        for step in sorted(steps):
            yield {"run_id": run_id, "rank": rank, "step": step, **steps[step]}


def upgrade() -> None:
    _aside("step_timings", "step_timings_rows")
    op.create_table(
        "step_timings",
        sa.Column("run_id", BigId, nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("first_step", sa.BigInteger(), nullable=False),
        sa.Column("sent_at", sa.Float(), nullable=False),
        sa.Column("last_step", sa.BigInteger(), nullable=False),
        *(sa.Column(v, sa.LargeBinary(), nullable=False) for v in VALUES),
        sa.PrimaryKeyConstraint("run_id", "rank", "first_step", "sent_at", name=op.f("pk_step_timings")),
        postgresql_with={"toast_tuple_target": 8160},
    )
    _inserted(_packed_table("step_timings"), _packed_rows())
    op.drop_table("step_timings_rows")


def downgrade() -> None:
    _aside("step_timings", "step_timings_packed")
    op.create_table(
        "step_timings",
        sa.Column("run_id", BigId, nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("step_time_s", sa.Float(), nullable=False),
        sa.Column("data_wait_s", sa.Float(), nullable=False),
        sa.Column("sync_s", sa.Float(), nullable=True),
        sa.Column("cpu_s", sa.Float(), nullable=True),
        sa.Column("runq_s", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("run_id", "rank", "step", name=op.f("pk_step_timings")),
    )
    _inserted(_rows_table("step_timings"), _step_rows("step_timings_packed"))
    op.drop_table("step_timings_packed")
