"""PostgreSQL statements of ingest: a group's rows in one statement per table.

The statements are fixed driver SQL (``exec_driver_sql``: no compilation, but
SQLAlchemy still translates errors and invalidates a dead connection). Each column
travels as one array parameter and ``unnest`` turns the arrays back into rows, so a
table costs one round trip whatever the group's size: numeric columns as binary arrays
built from numpy (``pg_arrays.py``), the few others as literals (psycopg would adapt
a list element by element in Python). Rows arrive folded (one per key,
``ingest/fold.py``) and sorted by key, and the tables are written in a fixed order (claims,
ranks, rank windows, job steps), so two collectors writing the same steps wait for each
other but cannot deadlock.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
from sqlalchemy import Connection

from ..ingest.fold import Columns, Rows
from ..schemas import IngestPayload
from . import pg_arrays
from .models import INT32_MAX, INT64_MAX


def _sat(col: str, limit: int) -> str:
    """``t.col + excluded.col``, saturating at ``limit`` (the column's largest value)
    instead of failing the batch with an overflow; both sides are non-negative."""
    return f"CASE WHEN t.{col} > {limit} - excluded.{col} THEN {limit} ELSE t.{col} + excluded.{col} END"


_CLAIM = """
    INSERT INTO ingested_batches (batch_id, run_id, rank, received_at)
    SELECT b, r, k, now()
    FROM unnest(CAST(%(batch_id)s AS text[]), CAST(%(run_id)s AS bigint[]),
                CAST(%(rank)s AS int[])) AS u(b, r, k)
    ORDER BY 2, 1
    ON CONFLICT (run_id, batch_id) DO NOTHING
    RETURNING run_id, batch_id
    """

_RANKS = """
    INSERT INTO ranks AS t (run_id, rank, host, local_rank, coords, last_step, last_seen,
                            agent_version, clock, dropped_windows, dropped_steps, hot_path_mean_s,
                            final_step)
    SELECT run_id, rank, host, local_rank, coords, last_step, to_timestamp(last_seen), agent_version,
           clock, dropped_windows, dropped_steps, hot_path_mean_s, final_step
    FROM unnest(CAST(%(run_id)s AS bigint[]), CAST(%(rank)s AS int[]), CAST(%(host)s AS text[]),
                         CAST(%(local_rank)s AS int[]), CAST(%(coords)s AS json[]),
                         CAST(%(last_step)s AS bigint[]), CAST(%(last_seen)s AS float8[]),
                         CAST(%(agent_version)s AS text[]), CAST(%(clock)s AS text[]),
                         CAST(%(dropped_windows)s AS bigint[]), CAST(%(dropped_steps)s AS bigint[]),
                         CAST(%(hot_path_mean_s)s AS float8[]), CAST(%(final_step)s AS bigint[]))
         AS u(run_id, rank, host, local_rank, coords, last_step, last_seen, agent_version, clock,
              dropped_windows, dropped_steps, hot_path_mean_s, final_step)
    ON CONFLICT (run_id, rank) DO UPDATE SET
        host = excluded.host,
        local_rank = excluded.local_rank,
        coords = excluded.coords,
        last_step = greatest(t.last_step, excluded.last_step),
        last_seen = greatest(t.last_seen, excluded.last_seen),
        agent_version = excluded.agent_version,
        clock = excluded.clock,
        dropped_windows = greatest(t.dropped_windows, excluded.dropped_windows),
        dropped_steps = greatest(t.dropped_steps, excluded.dropped_steps),
        hot_path_mean_s = coalesce(excluded.hot_path_mean_s, t.hot_path_mean_s),
        final_step = coalesce(excluded.final_step, t.final_step)
    """

_WINDOWS = f"""
    INSERT INTO rank_windows AS t (run_id, rank, "window", first_step, last_step, n_steps,
                                   step_time_sum, step_time_min, step_time_max, data_wait_sum,
                                   tokens_sum, padded_tokens_sum, wall_end)
    SELECT * FROM unnest(CAST(%(run_id)s AS bigint[]), CAST(%(rank)s AS int[]), CAST(%(window)s AS bigint[]),
                         CAST(%(first_step)s AS bigint[]), CAST(%(last_step)s AS bigint[]),
                         CAST(%(n_steps)s AS int[]), CAST(%(step_time_sum)s AS float8[]),
                         CAST(%(step_time_min)s AS float8[]), CAST(%(step_time_max)s AS float8[]),
                         CAST(%(data_wait_sum)s AS float8[]), CAST(%(tokens_sum)s AS bigint[]),
                         CAST(%(padded_tokens_sum)s AS bigint[]), CAST(%(wall_end)s AS float8[]))
    ON CONFLICT (run_id, rank, "window") DO UPDATE SET
        first_step = least(t.first_step, excluded.first_step),
        last_step = greatest(t.last_step, excluded.last_step),
        n_steps = {_sat("n_steps", INT32_MAX)},
        step_time_sum = t.step_time_sum + excluded.step_time_sum,
        step_time_min = least(t.step_time_min, excluded.step_time_min),
        step_time_max = greatest(t.step_time_max, excluded.step_time_max),
        data_wait_sum = t.data_wait_sum + excluded.data_wait_sum,
        tokens_sum = {_sat("tokens_sum", INT64_MAX)},
        padded_tokens_sum = coalesce({_sat("padded_tokens_sum", INT64_MAX)},
                                     t.padded_tokens_sum, excluded.padded_tokens_sum),
        wall_end = greatest(t.wall_end, excluded.wall_end)
    """

_JOB_STEPS = f"""
    INSERT INTO job_steps AS t (run_id, step, ranks, token_ranks, step_time_sum, step_time_max,
                                data_wait_max, tokens, padded_tokens, tag, wall_end)
    SELECT * FROM unnest(CAST(%(run_id)s AS bigint[]), CAST(%(step)s AS bigint[]), CAST(%(ranks)s AS int[]),
                         CAST(%(token_ranks)s AS int[]), CAST(%(step_time_sum)s AS float8[]),
                         CAST(%(step_time_max)s AS float8[]), CAST(%(data_wait_max)s AS float8[]),
                         CAST(%(tokens)s AS bigint[]), CAST(%(padded_tokens)s AS bigint[]),
                         CAST(%(tag)s AS smallint[]), CAST(%(wall_end)s AS float8[]))
    ON CONFLICT (run_id, step) DO UPDATE SET
        ranks = {_sat("ranks", INT32_MAX)},
        token_ranks = {_sat("token_ranks", INT32_MAX)},
        step_time_sum = t.step_time_sum + excluded.step_time_sum,
        step_time_max = greatest(t.step_time_max, excluded.step_time_max),
        data_wait_max = greatest(t.data_wait_max, excluded.data_wait_max),
        tokens = {_sat("tokens", INT64_MAX)},
        padded_tokens = coalesce({_sat("padded_tokens", INT64_MAX)},
                                 t.padded_tokens, excluded.padded_tokens),
        tag = greatest(t.tag, excluded.tag),
        wall_end = greatest(t.wall_end, excluded.wall_end)
    """

#: Columns that hold text (quoted in their literal); the rest are numbers.
_TEXT = frozenset({"host", "coords", "agent_version", "clock"})


def claim(
    conn: Connection, payloads: Sequence[IngestPayload], run_ids: Sequence[int]
) -> set[tuple[int, str]]:
    """Insert the batch ids; return the (run id, batch id) pairs that were new (a retry's
    is already there). ``payloads`` must not repeat a batch id within a run."""
    rows = conn.exec_driver_sql(
        _CLAIM,
        {
            "batch_id": _text_literal([p.batch_id for p in payloads]),
            "run_id": _literal(run_ids),
            "rank": _literal([p.rank.rank for p in payloads]),
        },
    )
    return {(r[0], r[1]) for r in rows}


def write(conn: Connection, rows: Rows) -> None:
    """Merge folded rows into ranks, rank windows and job steps, in that order."""
    for stmt, cols in ((_RANKS, rows.ranks), (_WINDOWS, rows.windows), (_JOB_STEPS, rows.job_steps)):
        if cols:
            conn.exec_driver_sql(stmt, _params(cols))


def _params(cols: Columns) -> dict[str, Any]:
    params = dict(cols)
    if "coords" in params:
        params["coords"] = [json.dumps(c, separators=(",", ":")) for c in params["coords"]]
    if "last_seen" in params:
        params["last_seen"] = [d.timestamp() for d in params["last_seen"]]
    return {
        k: _text_literal(v)
        if k in _TEXT
        else pg_arrays.encode(v)
        if isinstance(v, np.ndarray)
        else _literal(v)
        for k, v in params.items()
    }


def _literal(values: Sequence[int | float | None]) -> str:
    """A PostgreSQL array literal of numbers (``repr`` keeps every bit of a float)."""
    return "{" + ",".join("NULL" if v is None else repr(v) for v in values) + "}"


def _text_literal(values: Sequence[str | None]) -> str:
    """A PostgreSQL array literal of strings, each quoted (backslash and quote escaped)."""
    return "{" + ",".join("NULL" if v is None else '"' + _escape(v) + '"' for v in values) + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')
