"""Ingest's pipelined transaction on a real PostgreSQL (``PostgresStorage.pipeline``).

Statements in psycopg's pipeline mode are answered at the end of the block, after
SQLAlchemy returned from them, so their errors would reach ingest as psycopg's own, which
the group commit does not know: a value the database refuses must still be SQLAlchemy's
``DataError`` (answered 422 at its entry, its neighbours stored), a connection that died
must still be an error that invalidates it (answered 503, the pool hands out a live one
next), and the claim read inside the pipeline must see its rows. (An error answered
before the block's last statement is sent surfaces in SQLAlchemy's own call, as before.)"""

from __future__ import annotations

import pytest
from sqlalchemy import Engine, func, select, text
from sqlalchemy.exc import DataError, OperationalError

from stepwatch_server.ingest.store import Ingestor
from stepwatch_server.schemas.ingest import IngestPayload
from stepwatch_server.storage.backend import open_storage
from stepwatch_server.storage.models import IngestedBatch, Run

from ..payloads import payload


def _run_id(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(Run.id)).scalar_one())


def test_the_claim_inside_the_pipeline_reads_which_batches_are_new(pg_engine: Engine) -> None:
    storage = open_storage(pg_engine)
    first = IngestPayload.model_validate(payload(run="p", rank=0, world=2, first=1))
    Ingestor(storage).store(first)
    again = IngestPayload.model_validate(payload(run="p", rank=1, world=2, first=1))
    run_id = _run_id(pg_engine)
    with pg_engine.begin() as conn, storage.pipeline(conn):
        storage.lock_buckets(conn, [(run_id, 0)])  # unread, sent before it, as ingest does
        new = storage.claim(conn, [first, again], [run_id, run_id])
    assert new == {(run_id, again.batch_id)}


def _pipelined(engine: Engine, *statements: str) -> None:
    """``statements`` in one transaction's pipeline, the last answered when it ends."""
    storage = open_storage(engine)
    with engine.begin() as conn, storage.pipeline(conn):
        for sql in statements:
            conn.exec_driver_sql(sql)


def test_a_refused_value_in_the_pipeline_is_sqlalchemys_data_error(pg_engine: Engine) -> None:
    with pytest.raises(DataError):
        _pipelined(pg_engine, "SELECT 1", "SELECT CAST(40000 AS smallint)")
    with pg_engine.connect() as conn:  # the connection went back to the pool usable
        assert conn.execute(text("SELECT 2")).scalar_one() == 2


def test_a_connection_killed_in_the_pipeline_is_invalidated_and_the_next_one_works(pg_engine: Engine) -> None:
    storage = open_storage(pg_engine)
    Ingestor(storage).store(IngestPayload.model_validate(payload(run="k", rank=0, world=2, first=1)))
    with pytest.raises(OperationalError) as raised:
        _pipelined(pg_engine, "SELECT 1", "SELECT pg_terminate_backend(pg_backend_pid())")
    assert raised.value.connection_invalidated
    # A retried group on the next connection stores its batch (the pool replaced the dead one).
    late = IngestPayload.model_validate(payload(run="k", rank=1, world=2, first=1))
    assert Ingestor(storage).store_many([late]) == [True]
    with pg_engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(IngestedBatch)).scalar_one() == 2
