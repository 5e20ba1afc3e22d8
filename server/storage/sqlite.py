"""SQLite statements: one collector process, row-by-row statements.

The merges are the upserts generated from the column rules (``columns.py``), sent with
executemany; SQLAlchemy's types bind the values (JSON, timezone-aware datetimes) as the
models read them back. One process writes, so the analysis lock is always granted.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import datetime, timezone
from typing import Any, cast

from sqlalchemy import Connection, Engine, Table, literal_column
from sqlalchemy.dialects import sqlite

from ..schemas.ingest import IngestPayload
from . import columns, rollups
from .backend import Write
from .columns import Rows, Summed
from .models import IngestedBatch


class SqliteStorage:
    functions = columns.SqlFunctions(least="min", greatest="max")

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._upserts: dict[tuple[str, tuple[str, ...]], Any] = {}

    def insert(self, table: Table) -> Any:
        return sqlite.insert(table)

    def claim(
        self, conn: Connection, payloads: Sequence[IngestPayload], run_ids: Sequence[int]
    ) -> set[tuple[int, str]]:
        batches = cast(Table, IngestedBatch.__table__)
        now = datetime.now(timezone.utc)
        new: set[tuple[int, str]] = set()
        for p, run_id in zip(payloads, run_ids, strict=True):
            claimed = conn.execute(
                sqlite.insert(batches)
                .values(batch_id=p.batch_id, run_id=run_id, rank=p.rank.rank, received_at=now)
                .on_conflict_do_nothing(index_elements=["run_id", "batch_id"])
                .returning(batches.c.batch_id)
            ).first()
            if claimed is not None:
                new.add((run_id, p.batch_id))
        return new

    def prepare(self, rows: Rows) -> tuple[Write, ...]:
        writes = []
        for table, cols in rows.tables():
            if cols:
                names = tuple(cols)
                values = [v.tolist() if hasattr(v, "tolist") else v for v in cols.values()]
                params = [dict(zip(names, row, strict=True)) for row in zip(*values, strict=True)]
                buckets = rollups.touched(cols["run_id"], cols["step"]) if table is columns.JOB_STEPS else ()
                writes.append(Write(table, self._upsert(table, names), params, buckets))
        return tuple(writes)

    def write(self, conn: Connection, writes: Sequence[Write]) -> None:
        for w in writes:
            conn.execute(w.statement, w.params)
            if w.buckets:
                rollups.refresh(conn, self.insert, w.buckets)

    def _upsert(self, table: Summed, names: tuple[str, ...]) -> Any:
        key = (table.name, names)
        stmt = self._upserts.get(key)
        if stmt is None:
            merge: dict[str, Any] = {
                n: literal_column(columns.merge_sql(table, n, table.name, "excluded", self.functions))
                for n in names
                if n not in table.keys
            }
            stmt = sqlite.insert(table.table).on_conflict_do_update(
                index_elements=list(table.keys), set_=merge
            )
            self._upserts[key] = stmt
        return stmt

    def lock_buckets(self, conn: Connection, buckets: Sequence[tuple[int, int]]) -> None:
        pass  # writers take the database file in turn

    def pipeline(self, conn: Connection) -> AbstractContextManager[None]:
        return nullcontext()  # a file in this process: no round trips to save

    def lock_run(self, conn: Connection, run_id: int) -> bool:
        return True  # one collector process; its one worker thread analyses

    def reads_hold_no_snapshot(self, conn: Connection) -> AbstractContextManager[None]:
        return nullcontext()  # no row versions to keep: SQLite writers take the file in turn
