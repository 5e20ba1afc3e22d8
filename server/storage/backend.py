"""The storage interface: what ingest, retention and the worker need of a backend.

The collector speaks to SQLite (one process, a file) and to PostgreSQL (replicas, a
server); the tables and every merge rule are shared (``models.py``, ``columns.py``),
the statements that apply them differ. The backend is chosen once, by
:func:`open_storage` from the engine's dialect (the app factory, the CLI), and everything
backend-specific is a method of :class:`Storage`: ``sqlite.py`` and ``postgres.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy import Connection, Engine, Table

from ..schemas.ingest import IngestPayload
from .columns import Rows, SqlFunctions, Summed


@dataclass(frozen=True)
class Write:
    """One table's merge of folded rows, ready to send: the backend's statement, its
    parameters encoded, and the job-step buckets whose rollups it changes."""

    table: Summed
    statement: Any
    params: Any
    buckets: Sequence[tuple[int, int]] = ()


class Storage(Protocol):
    """One backend. Methods that take a connection run inside the caller's transaction."""

    engine: Engine
    #: The two-argument ``least``/``greatest`` functions in this backend's spelling.
    functions: SqlFunctions

    def insert(self, table: Table) -> Any:
        """This dialect's INSERT (with ``on_conflict_do_nothing``/``_do_update``)."""
        ...

    def claim(
        self, conn: Connection, payloads: Sequence[IngestPayload], run_ids: Sequence[int]
    ) -> set[tuple[int, str]]:
        """Insert the batch ids; return the (run id, batch id) pairs that were new (a
        retry's is already there). ``payloads`` must not repeat a batch id within a run."""
        ...

    def prepare(self, rows: Rows) -> tuple[Write, ...]:
        """The merges of folded rows into ranks, rank windows, job steps and the staged
        tables, in that order, each column by its rule (``columns.py``): statements and
        parameters built with no connection, so that ingest builds them before its
        transaction (a group holds the job-step locks from its first statement to its
        commit, and the next group waits that long: ``ingest/store.py``)."""
        ...

    def write(self, conn: Connection, writes: Sequence[Write]) -> None:
        """Send prepared merges (:meth:`prepare`), in their order."""
        ...

    def pipeline(self, conn: Connection) -> AbstractContextManager[None]:
        """Within it, statements whose answers are not read are sent without waiting for
        each other's (:meth:`claim` reads its own): a transaction's round trips while it
        holds locks others wait for. Errors may surface at a later statement or at its
        end, as the same ``sqlalchemy.exc`` errors."""
        ...

    def lock_buckets(self, conn: Connection, buckets: Sequence[tuple[int, int]]) -> None:
        """Take the (run id, bucket) job-step locks for this transaction, in the given
        (sorted) order: writers of a bucket take turns from here to their commit
        (``rollups.py``). :meth:`write` takes the locks of its rows itself; ingest takes
        them first, before its transaction writes anything (``ingest/store.py``)."""
        ...

    def lock_run(self, conn: Connection, run_id: int) -> bool:
        """Take the run's analysis lock for this transaction; False if another collector
        holds it."""
        ...

    def reads_hold_no_snapshot(self, conn: Connection) -> AbstractContextManager[None]:
        """Within it, each read of ``conn``'s open transaction lets the database forget its
        snapshot as soon as its rows are in the client, so that the computation between
        reads (seconds at thousands of ranks) holds back no one's cleanup."""
        ...


def is_postgres(bind: Connection | Engine) -> bool:
    """Whether ``bind`` speaks to PostgreSQL: the one test for the few reads that are
    written differently there (arrays, ``percentile_cont``), as :func:`open_storage` picks
    the backend."""
    return bind.dialect.name == "postgresql"


def open_storage(engine: Engine) -> Storage:
    """The implementation for ``engine``'s backend."""
    if is_postgres(engine):
        from .postgres import PostgresStorage

        return PostgresStorage(engine)
    from .sqlite import SqliteStorage

    return SqliteStorage(engine)
