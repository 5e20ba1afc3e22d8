"""PostgreSQL storage: a group's rows in one statement per table; advisory locks.

The ingest statements are generated once per table and column set from the column
rules (``columns.py``) and the models' types; they are fixed driver SQL
(``exec_driver_sql``: no compilation, but SQLAlchemy still translates errors and
invalidates a dead connection). Each column
travels as one array parameter and ``unnest`` turns the arrays back into rows, so a
table costs one statement whatever the group's size (and ingest sends them pipelined,
:meth:`PostgresStorage.pipeline`, one round trip for all): numeric columns as binary arrays
built from numpy (``pg_arrays.py``), packed steps (``packed.py``) as binary ``bytea[]``
the same way, the few others as literals
(psycopg would adapt a list element by element in Python). Rows arrive folded (one per key,
``ingest/fold.py``) and sorted by key, and the tables are written in a fixed order (claims,
ranks, rank windows, job steps), so two collectors writing the same steps wait for each
other but cannot deadlock.

``job_steps`` rows, merged again by every group that carries their step, are written
UPDATE first, then INSERT ... ON CONFLICT for the keys that the UPDATE did not find.
Merged by ``ON CONFLICT DO UPDATE`` alone, most old versions of such a row stayed in
their page until a VACUUM (the speculative-insertion path seldom prunes): ``job_steps``
grew to 10-15x its size. A plain UPDATE into a page with free space (fillfactor 50,
migration 0012) is a HOT update, and the page is pruned as it is read: measured alone on
the server, 32 merges of 192 rows left the table at its fresh size (ON CONFLICT: 8x).
Pruning can only drop versions no open transaction on the server may still see, so a
long transaction anywhere on the server (another database's included: a snapshot's
horizon counts every running transaction id) defers it. So does the next writer of the
same rows if its transaction id is older than the commit it waited for: ingest takes the
bucket locks below before its group writes anything (``ingest/store.py``), so that id is
taken after the wait.
An UPDATE's join visits rows in the table's physical order, not in key order, so two
writers updating the same rows could deadlock; they do not meet there: the writers of a
job-step bucket take turns (the bucket locks below, taken in key order before
``job_steps``), so no two transactions update the same ``job_steps`` rows at once.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
from sqlalchemy import (
    JSON,
    BigInteger,
    Connection,
    DateTime,
    Engine,
    Float,
    Integer,
    LargeBinary,
    SmallInteger,
    String,
    Table,
    event,
    func,
    select,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.exc import DBAPIError
from sqlalchemy.types import TypeEngine

from ..schemas.ingest import IngestPayload
from . import columns, pg_arrays, rollups
from .backend import Write
from .columns import Columns, Rows, Summed

_CLAIM = """
    INSERT INTO ingested_batches (batch_id, run_id, rank, received_at)
    SELECT b, r, k, now()
    FROM unnest(CAST(%(batch_id)s AS text[]), CAST(%(run_id)s AS bigint[]),
                CAST(%(rank)s AS int[])) AS u(b, r, k)
    ORDER BY 2, 1
    ON CONFLICT (run_id, batch_id) DO NOTHING
    RETURNING run_id, batch_id
    """

#: Tables whose rows are mostly merged into rather than inserted: UPDATE first (above).
UPDATED_IN_PLACE = frozenset({columns.JOB_STEPS.name})

#: Bucket locks, in key order (two writers cannot wait for each other): the two-key form,
#: a key space apart from the analysis locks' single key.
_BUCKET_LOCKS = """
    SELECT pg_advisory_xact_lock(CAST(mod(r, 2147483647) AS int), CAST(mod(b, 2147483647) AS int))
    FROM (SELECT r, b FROM unnest(CAST(%(run)s AS bigint[]), CAST(%(bucket)s AS bigint[])) AS u(r, b)
          ORDER BY r, b OFFSET 0) AS s
    """

#: Analysis locks: the run id in the low bits of a PostgreSQL advisory lock key.
_LOCK_NAMESPACE = 0x5357414E << 32


class PostgresStorage:
    functions = columns.SqlFunctions(least="least", greatest="greatest")

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._upserts: dict[tuple[str, tuple[str, ...]], str] = {}

    def insert(self, table: Table) -> Any:
        return postgresql.insert(table)

    def claim(
        self, conn: Connection, payloads: Sequence[IngestPayload], run_ids: Sequence[int]
    ) -> set[tuple[int, str]]:
        params = {
            "batch_id": _text_literal([p.batch_id for p in payloads]),
            "run_id": _literal(run_ids),
            "rank": _literal([p.rank.rank for p in payloads]),
        }
        # The driver's own cursor: its rows are read right (the answer awaited) inside a
        # pipeline (:meth:`pipeline`), where SQLAlchemy's result would be empty.
        driver: Any = conn.connection.driver_connection
        with _translated(conn, _CLAIM, params), driver.cursor() as cursor:
            cursor.execute(_CLAIM, params)
            rows = cursor.fetchall()
        return {(r[0], r[1]) for r in rows}

    def prepare(self, rows: Rows) -> tuple[Write, ...]:
        return tuple(
            Write(
                table,
                self._upsert(table, tuple(cols)),
                _params(table, cols),
                rollups.touched(cols["run_id"], cols["step"]) if table is columns.JOB_STEPS else (),
            )
            for table, cols in rows.tables()
            if cols
        )

    def write(self, conn: Connection, writes: Sequence[Write]) -> None:
        for w in writes:
            if w.buckets:
                # Writers of a bucket take turns from here to their commit, so each
                # recompute below sees every step committed before it (rollups.py).
                # Ingest holds them already (a lock taken twice in one transaction is
                # granted at once); other callers get them here.
                self.lock_buckets(conn, w.buckets)
            conn.exec_driver_sql(w.statement, w.params)
            if w.buckets:
                rollups.refresh(conn, self.insert, w.buckets)

    @contextmanager
    def pipeline(self, conn: Connection) -> Iterator[None]:
        """psycopg's pipeline mode: each statement is sent without waiting for the answer
        to the one before, all answered when a result is read (:meth:`claim`) or the
        block ends. A statement the server refuses raises at one of those, or in a later
        call through SQLAlchemy that finds its answer (translated by SQLAlchemy, which
        then names its own statement); at the block's end it is a psycopg error
        SQLAlchemy has not seen, which :func:`_translated` raises as SQLAlchemy would.
        (psycopg then logs the statements the server skipped after the refusal.)"""
        driver: Any = conn.connection.driver_connection
        with _translated(conn), driver.pipeline():
            yield

    def lock_buckets(self, conn: Connection, buckets: Sequence[tuple[int, int]]) -> None:
        if buckets:
            conn.exec_driver_sql(
                _BUCKET_LOCKS,
                {"run": _literal([r for r, _ in buckets]), "bucket": _literal([b for _, b in buckets])},
            )

    def lock_run(self, conn: Connection, run_id: int) -> bool:
        key = _LOCK_NAMESPACE | run_id
        return bool(conn.execute(select(func.pg_try_advisory_xact_lock(key))).scalar())

    @contextmanager
    def reads_hold_no_snapshot(self, conn: Connection) -> Iterator[None]:
        """After each read of ``conn`` (its rows are all in the client: psycopg's cursors
        are client-side), a statement sent as a simple query. A query with parameters
        runs in the unnamed portal of the extended protocol, which keeps its snapshot
        after the last row until the next statement: a session idle in its transaction
        then shows a ``backend_xmin``, and no row version deleted after it can be pruned
        anywhere on the server. The analysis worker, turning each chunk of rows it read
        into its detectors' types before the next read (for seconds at thousands of
        ranks), so held back the pruning of ``job_steps``, which every group commit
        updates in place: sampled during the benchmark's PostgreSQL phases, its session
        held a snapshot, idle in transaction, in about a quarter of the samples, and the
        table ended at 761-1678 B per row, against 526-548 with the worker off (299
        freshly copied). A simple query replaces the unnamed portal and the session
        holds no snapshot. Sent by the driver itself with ``prepare=False``: psycopg
        prepares a statement it has run five times on a connection (the pool's ping is
        the same ``SELECT 1``), and a prepared one runs in the unnamed portal again."""
        driver: Any = conn.connection.driver_connection

        def release(_c: Any, cursor: Any, _s: Any, _p: Any, ctx: Any, _many: bool) -> None:
            if cursor.description is not None and not (ctx.isinsert or ctx.isupdate or ctx.isdelete):
                driver.execute("SELECT 1", prepare=False)

        event.listen(conn, "after_cursor_execute", release)
        try:
            yield
        finally:
            event.remove(conn, "after_cursor_execute", release)

    def _upsert(self, table: Summed, names: tuple[str, ...]) -> str:
        key = (table.name, names)
        stmt = self._upserts.get(key)
        if stmt is None:
            stmt = _upsert_sql(table, names, self.functions)
            self._upserts[key] = stmt
        return stmt


@contextmanager
def _translated(
    conn: Connection, statement: str = "(pipelined statements)", params: dict[str, Any] | None = None
) -> Iterator[None]:
    """Errors of statements sent by the driver directly (:meth:`PostgresStorage.claim`)
    or answered after SQLAlchemy returned (:meth:`PostgresStorage.pipeline`) raised as
    the ``sqlalchemy.exc`` error SQLAlchemy raises for its own (``DataError`` for a value
    a column cannot hold: ingest's group commit relies on it), a connection found dead
    invalidated as SQLAlchemy invalidates it."""
    dbapi: Any = conn.dialect.dbapi
    try:
        yield
    except dbapi.Error as exc:
        gone = conn.dialect.is_disconnect(exc, conn.connection.dbapi_connection, None)
        if gone:
            conn.invalidate(exc)
        raise DBAPIError.instance(
            statement, params, exc, dbapi.Error, connection_invalidated=gone, dialect=conn.dialect
        ) from exc


def _upsert_sql(table: Summed, names: Sequence[str], fn: columns.SqlFunctions) -> str:
    """``INSERT ... SELECT FROM unnest(<one array per column>) ON CONFLICT DO UPDATE``,
    the arrays typed from the model, the merge from the column rules; for the tables
    updated in place, preceded by an UPDATE of the rows that exist (module docstring)."""
    cols = ", ".join(columns.quote(n) for n in names)
    arrays = ", ".join(f"CAST(%({n})s AS {_pg_type(table.table.c[n].type)}[])" for n in names)
    select_ = ", ".join(
        f"to_timestamp({columns.quote(n)})"
        if isinstance(table.table.c[n].type, DateTime)
        else columns.quote(n)
        for n in names
    )
    keys = [columns.quote(k) for k in table.keys]
    upsert = (
        f"INSERT INTO {table.name} AS t ({cols})\n"
        "{source}\n"
        f"ON CONFLICT ({', '.join(keys)}) DO UPDATE SET\n"
        + columns.set_clause(table, names, "t", "excluded", fn)
    )
    rows = f"SELECT {select_} FROM unnest({arrays}) AS u({cols})"
    if table.name not in UPDATED_IN_PLACE:
        return upsert.format(source=rows)
    # The UPDATE's RETURNING names the keys it merged, the rest are inserted (or merged by
    # ON CONFLICT if another writer inserted them meanwhile).
    on = " AND ".join(f"t.{k} = u.{k}" for k in keys)
    found = " AND ".join(f"d.{k} = u.{k}" for k in keys)
    return (
        f"WITH u ({cols}) AS MATERIALIZED ({rows}),\n"
        f"done AS (UPDATE {table.name} AS t SET\n"
        + columns.set_clause(table, names, "t", "u", fn)
        + f"\nFROM u WHERE {on} RETURNING {', '.join(f't.{k}' for k in keys)})\n"
        + upsert.format(
            source=f"SELECT {cols} FROM u WHERE NOT EXISTS (SELECT 1 FROM done AS d WHERE {found})"
        )
    )


def _pg_type(sql_type: TypeEngine[Any]) -> str:
    """The array element type a column travels as (a timestamp as Unix seconds)."""
    for kind, name in (
        (SmallInteger, "smallint"),
        (BigInteger, "bigint"),
        (Integer, "int"),
        (Float, "float8"),
        (DateTime, "float8"),
        (JSON, "json"),
        (String, "text"),
        (LargeBinary, "bytea"),
    ):
        if isinstance(sql_type, kind):
            return name
    raise TypeError(f"no array type for {sql_type!r}")


#: ``json.dumps(value, separators=(",", ":"))`` with its encoder made once: ``dumps`` builds
#: a new ``JSONEncoder`` on every call given any option, 3.4 µs against 2.0 µs for a rank's
#: coordinates, and every rank row of every window carries them.
_to_json = json.JSONEncoder(separators=(",", ":")).encode


def _params(table: Summed, cols: Columns) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for name, values in cols.items():
        kind = table.table.c[name].type
        if isinstance(kind, JSON):
            params[name] = _text_literal([_to_json(c) for c in values])
        elif isinstance(kind, String):
            params[name] = _text_literal(values)
        elif isinstance(kind, DateTime):
            params[name] = _literal([d.timestamp() for d in values])
        elif isinstance(kind, LargeBinary):  # packed steps (``packed.py``)
            params[name] = pg_arrays.encode_bytes(values)
        elif isinstance(values, np.ndarray):
            params[name] = pg_arrays.encode(values)
        else:
            params[name] = _literal(values)
    return params


def _literal(values: Sequence[int | float | None]) -> str:
    """A PostgreSQL array literal of numbers (``repr`` keeps every bit of a float)."""
    return "{" + ",".join("NULL" if v is None else repr(v) for v in values) + "}"


def _text_literal(values: Sequence[str | None]) -> str:
    """A PostgreSQL array literal of strings, each quoted (backslash and quote escaped)."""
    return "{" + ",".join("NULL" if v is None else '"' + _escape(v) + '"' for v in values) + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')
