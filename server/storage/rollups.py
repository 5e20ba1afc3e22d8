"""Job steps rolled up per run into buckets of steps, kept up to date by ingest.

The overview and a series over a month of steps used to scan every ``job_steps`` row of
the run (223 ms and 376-522 ms at 30 days). ``job_step_buckets`` holds one row per run
and bucket of :data:`BUCKET_STEPS` steps; readers merge bucket rows (and the few raw
steps at the edges of a requested range), so they read O(points returned), whatever
the run's history.

A bucket row is not merged additively with what a new batch adds: the values it rolls
up are per-step *ratios* (step time = sum over ranks / ranks reporting, global tokens
scaled from the reporting replicas), and a step's ratio changes as its ranks arrive.
So ingest recomputes the buckets a group touched from their (at most
``BUCKET_STEPS``) steps, inside the group's transaction, after merging ``job_steps``:
the row is exactly the aggregate of its steps, by each column's rule
(``columns.JOB_STEP_BUCKETS``: SUM, MIN or MAX of one per-step value), and the same
rules merge buckets into series points and the run's totals. The statements are
generated from those rules. On PostgreSQL, writers of the same bucket are serialised
by a transaction advisory lock taken before the group writes anything (``postgres.py``,
``ingest/store.py``), so a recompute always sees every step committed before it.

The per-step values are defined here once and imported by the readers
(``reads/queries.py``), so a bucket and a raw step can never disagree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import numpy as np
from sqlalchemy import Connection, Float, Table, and_, bindparam, case, false, literal, or_, select
from sqlalchemy import cast as sql_cast
from sqlalchemy.sql.elements import ColumnElement

from .columns import JOB_STEP_BUCKETS, Rule, aggregate, window_of
from .models import JobStep, JobStepBucket, Run

#: Steps per bucket: a month of 10 s steps is 4,050 buckets, and a series whose points
#: are narrower than a bucket reads at most this many raw steps per point.
BUCKET_STEPS = 64

JS = JobStep.__table__
JB = cast(Table, JobStepBucket.__table__)
RUNS = Run.__table__

Dp = ColumnElement[Any] | int


# -- the per-step job values ----------------------------------------------------------
def step_time() -> ColumnElement[Any]:
    """Mean step time over the ranks that reported the step (in floating point: an
    integer divisor would make PostgreSQL divide in ``numeric``, several times slower)."""
    return JS.c.step_time_sum / sql_cast(JS.c.ranks, Float)


def tokens_est(dp: Dp) -> ColumnElement[Any]:
    """Global tokens of the step: the reporting replicas' tokens scaled to ``dp`` replicas."""
    return sql_cast(JS.c.tokens, Float) * dp / sql_cast(JS.c.token_ranks, Float)


def usable() -> ColumnElement[bool]:
    """Steps the readers count: some replica's tokens and a positive step time."""
    return and_(JS.c.token_ranks > 0, JS.c.step_time_sum > 0)


#: Per-step values of the series, by the prefix of their bucket columns.
VALUES: dict[str, Callable[[Dp], ColumnElement[Any]]] = {
    "step_time": lambda dp: step_time(),
    "slowest": lambda dp: JS.c.step_time_max,
    "data_wait": lambda dp: JS.c.data_wait_max,
    "tokens_per_s": lambda dp: tokens_est(dp) / step_time(),
    "ranks": lambda dp: sql_cast(JS.c.ranks, Float),
}


def _sources(dp: Dp) -> dict[str, ColumnElement[Any]]:
    """The per-step value each non-key bucket column aggregates (by its rule)."""
    untagged = JS.c.tag == 0
    out: dict[str, ColumnElement[Any]] = {
        "n_steps": literal(1),
        "first_step": JS.c.step,
        "last_step": JS.c.step,
        "tokens_est": tokens_est(dp),
        # As floats: a sum of saturated BIGINTs must not overflow (SQLite's sum() raises).
        "tokens": sql_cast(JS.c.tokens, Float),
        "padded_tokens": sql_cast(JS.c.padded_tokens, Float),
        "untagged_steps": case((untagged, 1), else_=0),
        "untagged_step_time": case((untagged, step_time()), else_=0.0),
        "untagged_tokens_est": case((untagged, tokens_est(dp)), else_=0.0),
        "untagged_data_wait": case((untagged, JS.c.data_wait_max), else_=0.0),
    }
    for prefix, value in VALUES.items():
        for part in ("sum", "min", "max"):
            out[f"{prefix}_{part}"] = value(dp)
    return out


def _bucket_of_step() -> ColumnElement[Any]:
    # Integer division truncates on both backends; step 0 joins bucket 0 (window_of).
    return (JS.c.step - 1) // BUCKET_STEPS


def _recompute(
    insert: Callable[[Table], Any], where: ColumnElement[bool], only: Sequence[str] | None = None
) -> Any:
    """``INSERT INTO job_step_buckets SELECT <rule(value)>... GROUP BY run, bucket``
    replacing the rows of the buckets it recomputes (``only``: these columns)."""
    t = JOB_STEP_BUCKETS
    names = [c.name for c in t.columns if c.rule is not Rule.KEY and (only is None or c.name in only)]
    src = _sources(RUNS.c.dp_size)
    bucket = _bucket_of_step()
    q = (
        select(
            JS.c.run_id,
            bucket.label("bucket"),
            *(aggregate(t.column(n).rule, src[n]).label(n) for n in names),
        )
        .select_from(JS.join(RUNS, RUNS.c.id == JS.c.run_id))
        .where(usable(), where)
        .group_by(JS.c.run_id, bucket)
    )
    stmt = insert(JB).from_select(["run_id", "bucket", *names], q)
    return stmt.on_conflict_do_update(index_elements=list(t.keys), set_={n: stmt.excluded[n] for n in names})


def touched(run_ids: Any, steps: Any) -> list[tuple[int, int]]:
    """The (run id, bucket) pairs of a group's ``job_steps`` rows, sorted (lock order)."""
    if len(steps) == 0:
        return []
    runs = np.asarray(run_ids, dtype=np.int64)
    buckets = window_of(np.asarray(steps, dtype=np.int64), np.full(len(runs), BUCKET_STEPS, dtype=np.int64))
    pairs = np.unique(np.stack([runs, buckets], axis=1), axis=0)
    return [(int(r), int(b)) for r, b in pairs]


def buckets_of(spans: Iterable[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """The (run id, bucket) pairs holding steps ``first .. last`` of each (run id, first,
    last), sorted (lock order): the buckets a group's ``job_steps`` rows fall in, known
    from its batches before they are folded (the same as :func:`touched` of the folded
    rows: ``tests/unit/test_fold.py``)."""
    pairs: set[tuple[int, int]] = set()
    for run_id, first, last in spans:
        lo, hi = window_of(first, BUCKET_STEPS), window_of(last, BUCKET_STEPS)
        pairs.update((run_id, b) for b in range(lo, hi + 1))
    return sorted(pairs)


def _spans(pairs: Iterable[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(run id, first step, last step) of each run of adjacent buckets among ``pairs``."""
    spans: list[list[int]] = []
    for run_id, b in sorted(pairs):
        if spans and spans[-1][0] == run_id and spans[-1][2] == b - 1:
            spans[-1][2] = b
        else:
            spans.append([run_id, b, b])
    return [(r, 0 if lo == 0 else lo * BUCKET_STEPS + 1, (hi + 1) * BUCKET_STEPS) for r, lo, hi in spans]


def _ranges(n: int) -> ColumnElement[bool]:
    """Steps of ``n`` primary-key ranges, bound as ``run_<i>``, ``lo_<i>``, ``hi_<i>``."""
    return or_(
        false(),
        *(
            and_(
                JS.c.run_id == bindparam(f"run_{i}"),
                JS.c.step >= bindparam(f"lo_{i}"),
                JS.c.step <= bindparam(f"hi_{i}"),
            )
            for i in range(n)
        ),
    )


#: The recompute statement of each number of spans (and each ``insert``): building it
#: took about a fifth of a group's time in the collector, per group; only its bounds vary.
_REFRESH: dict[tuple[Callable[[Table], Any], int], Any] = {}


def refresh(conn: Connection, insert: Callable[[Table], Any], pairs: Iterable[tuple[int, int]]) -> None:
    """Recompute the given buckets from their steps (ingest, after merging job steps)."""
    spans = _spans(pairs)
    if not spans:
        return
    key = (insert, len(spans))
    stmt = _REFRESH.get(key)
    if stmt is None:
        stmt = _recompute(insert, _ranges(len(spans)))
        if len(_REFRESH) < 64:  # a group touching many runs is rare: not worth keeping
            _REFRESH[key] = stmt
    params: dict[str, int] = {}
    for i, (run_id, lo, hi) in enumerate(spans):
        params.update({f"run_{i}": run_id, f"lo_{i}": lo, f"hi_{i}": hi})
    conn.execute(stmt, params)


def rebuild(
    conn: Connection,
    insert: Callable[[Table], Any],
    run_id: int | None = None,
    *,
    only: Sequence[str] | None = None,
) -> None:
    """Recompute every bucket (of one run, or of all): the migration's backfill (which
    names the columns it created in ``only``), and tools that write ``job_steps``
    without ingest (the query benchmark)."""
    where = JS.c.run_id == run_id if run_id is not None else JS.c.run_id.is_not(None)
    conn.execute(_recompute(insert, where, only))
