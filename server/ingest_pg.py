"""PostgreSQL statements of ingest: a group's rows in one statement per table.

Each column travels as one array literal and ``unnest`` turns the arrays back into rows,
so a table costs one round trip whatever the group's size. Literals, not Python lists:
psycopg adapts a list element by element in Python. Rows arrive folded (one per key,
``aggregate.py``) and sorted by key, and the tables are written in a fixed order (claims,
ranks, rank windows, job steps), so two collectors writing the same steps wait for each
other but cannot deadlock.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import Connection, text

from .aggregate import Columns, Rows
from .schemas import IngestPayload

_CLAIM = text(
    """
    INSERT INTO ingested_batches (batch_id, run_id, rank, received_at)
    SELECT * FROM unnest(CAST(:batch_id AS text[]), CAST(:run_id AS bigint[]),
                         CAST(:rank AS int[]), CAST(:received_at AS timestamptz[]))
    ORDER BY 1
    ON CONFLICT (batch_id) DO NOTHING
    RETURNING batch_id
    """
)

_RANKS = text(
    """
    INSERT INTO ranks AS t (run_id, rank, host, local_rank, coords, last_step, last_seen,
                            agent_version, clock, dropped_windows, dropped_steps, hot_path_mean_s)
    SELECT * FROM unnest(CAST(:run_id AS bigint[]), CAST(:rank AS int[]), CAST(:host AS text[]),
                         CAST(:local_rank AS int[]), CAST(:coords AS json[]),
                         CAST(:last_step AS bigint[]), CAST(:last_seen AS timestamptz[]),
                         CAST(:agent_version AS text[]), CAST(:clock AS text[]),
                         CAST(:dropped_windows AS bigint[]), CAST(:dropped_steps AS bigint[]),
                         CAST(:hot_path_mean_s AS float8[]))
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
        hot_path_mean_s = coalesce(excluded.hot_path_mean_s, t.hot_path_mean_s)
    """
)

_WINDOWS = text(
    """
    INSERT INTO rank_windows AS t (run_id, rank, "window", first_step, last_step, n_steps,
                                   step_time_sum, step_time_min, step_time_max, data_wait_sum,
                                   tokens_sum, padded_tokens_sum, wall_end)
    SELECT * FROM unnest(CAST(:run_id AS bigint[]), CAST(:rank AS int[]), CAST(:window AS bigint[]),
                         CAST(:first_step AS bigint[]), CAST(:last_step AS bigint[]),
                         CAST(:n_steps AS int[]), CAST(:step_time_sum AS float8[]),
                         CAST(:step_time_min AS float8[]), CAST(:step_time_max AS float8[]),
                         CAST(:data_wait_sum AS float8[]), CAST(:tokens_sum AS bigint[]),
                         CAST(:padded_tokens_sum AS bigint[]), CAST(:wall_end AS float8[]))
    ON CONFLICT (run_id, rank, "window") DO UPDATE SET
        first_step = least(t.first_step, excluded.first_step),
        last_step = greatest(t.last_step, excluded.last_step),
        n_steps = t.n_steps + excluded.n_steps,
        step_time_sum = t.step_time_sum + excluded.step_time_sum,
        step_time_min = least(t.step_time_min, excluded.step_time_min),
        step_time_max = greatest(t.step_time_max, excluded.step_time_max),
        data_wait_sum = t.data_wait_sum + excluded.data_wait_sum,
        tokens_sum = t.tokens_sum + excluded.tokens_sum,
        padded_tokens_sum = coalesce(t.padded_tokens_sum + excluded.padded_tokens_sum,
                                     t.padded_tokens_sum, excluded.padded_tokens_sum),
        wall_end = greatest(t.wall_end, excluded.wall_end)
    """
)

_JOB_STEPS = text(
    """
    INSERT INTO job_steps AS t (run_id, step, ranks, token_ranks, step_time_sum, step_time_max,
                                data_wait_max, tokens, padded_tokens, tag, wall_end)
    SELECT * FROM unnest(CAST(:run_id AS bigint[]), CAST(:step AS bigint[]), CAST(:ranks AS int[]),
                         CAST(:token_ranks AS int[]), CAST(:step_time_sum AS float8[]),
                         CAST(:step_time_max AS float8[]), CAST(:data_wait_max AS float8[]),
                         CAST(:tokens AS bigint[]), CAST(:padded_tokens AS bigint[]),
                         CAST(:tag AS smallint[]), CAST(:wall_end AS float8[]))
    ON CONFLICT (run_id, step) DO UPDATE SET
        ranks = t.ranks + excluded.ranks,
        token_ranks = t.token_ranks + excluded.token_ranks,
        step_time_sum = t.step_time_sum + excluded.step_time_sum,
        step_time_max = greatest(t.step_time_max, excluded.step_time_max),
        data_wait_max = greatest(t.data_wait_max, excluded.data_wait_max),
        tokens = t.tokens + excluded.tokens,
        padded_tokens = coalesce(t.padded_tokens + excluded.padded_tokens,
                                 t.padded_tokens, excluded.padded_tokens),
        tag = greatest(t.tag, excluded.tag),
        wall_end = greatest(t.wall_end, excluded.wall_end)
    """
)

#: Columns that hold text: passed as lists (psycopg quotes them); the rest as literals.
_TEXT = frozenset({"host", "coords", "agent_version", "clock", "last_seen"})


def claim(conn: Connection, payloads: Sequence[IngestPayload], run_ids: Sequence[int]) -> set[str]:
    """Insert the batch ids; return those that were new (a retry's id is already there).
    ``payloads`` must not repeat a batch id."""
    now = datetime.now(timezone.utc)
    rows = conn.execute(
        _CLAIM,
        {
            "batch_id": [p.batch_id for p in payloads],
            "run_id": _literal(run_ids),
            "rank": _literal([p.rank.rank for p in payloads]),
            "received_at": [now] * len(payloads),
        },
    )
    return {r[0] for r in rows}


def write(conn: Connection, rows: Rows) -> None:
    """Merge folded rows into ranks, rank windows and job steps, in that order."""
    for stmt, cols in ((_RANKS, rows.ranks), (_WINDOWS, rows.windows), (_JOB_STEPS, rows.job_steps)):
        if cols:
            conn.execute(stmt, _params(cols))


def _params(cols: Columns) -> dict[str, Any]:
    params = {k: v if k in _TEXT else _literal(v) for k, v in cols.items()}
    if "coords" in params:
        params["coords"] = [json.dumps(c) for c in params["coords"]]
    return params


def _literal(values: Sequence[int | float | None]) -> str:
    """A PostgreSQL array literal of numbers (``repr`` keeps every bit of a float)."""
    return "{" + ",".join("NULL" if v is None else repr(v) for v in values) + "}"
