"""The database's own speed for the ingest benchmark: raw ``COPY`` of exactly the rows the
collector stores for a set of payloads, into the same tables (same indexes), in the same
database server and the same run.

The rows are the collector's own: the payloads are validated by its schema and folded by
its fold (``ingest/fold.py``) into the final rows of ``ranks``, ``rank_windows`` and
``job_steps``, plus one ``ingested_batches`` claim per batch. They are formatted as COPY
text before the clock starts, so the figure is the server's: parse, insert, index,
commit (one transaction per call, as durable as the collector's commits).

The same rows also give the nominal size of a ``job_steps`` row: freshly copied, never
updated, the table's total size (heap, TOAST, indexes) over its rows.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

import numpy as np
import psycopg

from stepwatch_server.ingest import fold
from stepwatch_server.ingest.store import choose_window_steps
from stepwatch_server.schemas.ingest import IngestBatches, IngestPayload
from stepwatch_server.storage import columns


def _text(value: Any) -> str:
    if value is None or value is np.ma.masked:
        return "\\N"
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, bytes):  # bytea in hex, its backslash escaped for COPY's text format
        return "\\\\x" + value.hex()
    if isinstance(value, dict):
        value = json.dumps(value, separators=(",", ":"))
    if isinstance(value, (float, np.floating)):
        return repr(float(value))
    s = str(value)
    return s.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n")


def _lines(cols: dict[str, Any]) -> bytes:
    names = list(cols)
    values = []
    for n in names:
        v = cols[n]
        if isinstance(v, np.ma.MaskedArray):
            values.append(
                [None if m else x for x, m in zip(v.data.tolist(), np.ma.getmaskarray(v), strict=True)]
            )
        elif isinstance(v, np.ndarray):
            values.append(v.tolist())
        else:
            values.append(list(v))
    return "".join("\t".join(_text(x) for x in row) + "\n" for row in zip(*values, strict=True)).encode()


def _payloads(body: bytes) -> list[IngestPayload]:
    if body.startswith(b'{"batches":'):
        return IngestBatches.model_validate_json(body).batches
    return [IngestPayload.model_validate_json(body)]


class CopyLoad:
    """The COPY data of one set of payloads, ready to send (``run_id`` names a run row
    that :meth:`prepare` creates). A host batch's body (``{"batches": [...]}``) gives the
    rows of each of its payloads, as the collector stores them."""

    def __init__(self, bodies: Sequence[bytes], window_seconds: float = 10.0) -> None:
        self.payloads = [p for b in bodies for p in _payloads(b)]
        self.rank_steps = sum(len(p.steps.time_s) for p in self.payloads)
        self.window_steps = choose_window_steps(self.payloads[0].steps.time_s, window_seconds)
        self.run_id = 0
        self.tables: list[tuple[str, list[str], bytes]] = []

    def prepare(self, conn: psycopg.Connection[Any], name: str) -> None:
        p = self.payloads[0]
        row = conn.execute(
            "INSERT INTO runs (name, world_size, dp_size, layout, window_steps, created_at) "
            "VALUES (%s, %s, %s, %s, %s, now()) RETURNING id",
            (
                name,
                p.rank.world_size,
                p.rank.layout.dp,
                json.dumps(p.rank.layout.model_dump()),
                self.window_steps,
            ),
        ).fetchone()
        conn.commit()
        assert row is not None
        self.run_id = int(row[0])
        n = len(self.payloads)
        rows = fold.fold(self.payloads, [self.run_id] * n, [self.window_steps] * n)
        now = datetime.now(timezone.utc)
        claims = {
            "batch_id": [q.batch_id for q in self.payloads],
            "run_id": [self.run_id] * n,
            "rank": [q.rank.rank for q in self.payloads],
            "received_at": [now] * n,
        }
        self.tables = [("ingested_batches", list(claims), _lines(claims))]
        for table, cols in rows.tables():
            if cols:
                self.tables.append((table.name, list(cols), _lines(cols)))

    def rows(self) -> int:
        return sum(data.count(b"\n") for _, _, data in self.tables)

    def copy(self, conn: psycopg.Connection[Any]) -> float:
        """Seconds to COPY every row in one transaction, commit included."""
        t0 = time.perf_counter()
        with conn.transaction():
            for name, cols, data in self.tables:
                quoted = ", ".join(columns.quote(c) for c in cols)
                with conn.cursor().copy(f"COPY {name} ({quoted}) FROM STDIN") as cp:
                    cp.write(data)
        return time.perf_counter() - t0


def table_bytes_per_row(conn: psycopg.Connection[Any], table: str) -> float:
    """``pg_total_relation_size`` (heap, TOAST, indexes, free space maps) over live rows."""
    row = conn.execute(
        f"SELECT pg_total_relation_size('{table}')::float8 / greatest(count(*), 1) FROM {table}"
    ).fetchone()
    assert row is not None
    return float(row[0])


def hot_share(conn: psycopg.Connection[Any], table: str) -> float:
    """The share of ``table``'s updates that were HOT (no new index entry, the old version
    prunable in its page as soon as no open transaction on the server can see it)."""
    row = conn.execute(
        "SELECT n_tup_hot_upd::float8 / greatest(n_tup_upd, 1) FROM pg_stat_user_tables WHERE relname = %s",
        (table,),
    ).fetchone()
    assert row is not None
    return float(row[0])
