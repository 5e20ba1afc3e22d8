"""The merge rule of every column of the summed tables, and everything derived from it.

A stored row of ``ranks``, ``rank_windows`` or ``job_steps`` summarises many steps, and
the same steps can reach it by several roads: folded with numpy inside one group commit
(``ingest/fold.py``), merged into an existing row by an upsert on SQLite
(``storage/sqlite.py``) or PostgreSQL (``storage/postgres.py``), or rolled up by
retention (``storage/retention.py``). Each road must give the same row, so each column's
rule is written once, here, and every road is generated from it:

- :func:`reduce` folds a numpy column per group (``reduceat``),
- :func:`merge_value` merges two Python values (the fold of ``ranks``),
- :func:`merge_sql` merges the stored row with a new one in an upsert (both backends),
- :func:`aggregate_sql` rolls rows up in a ``GROUP BY`` (retention),
- :func:`running_means` updates breakdown means in place, weighted by their count.

The step -> rank-window rule (:func:`window_of`) lives here too: it is the key of
``rank_windows``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, overload

import numpy as np
import numpy.typing as npt
from sqlalchemy import BigInteger, Integer, Table, bindparam, func
from sqlalchemy.sql.elements import ColumnElement

from .models import (
    INT32_MAX,
    INT64_MAX,
    JobStep,
    JobStepBucket,
    LinkSample,
    Rank,
    RankGroup,
    RankWindow,
    StepTiming,
)


class Rule(enum.Enum):
    """How two values of a column merge (``old`` stored, ``new`` arriving)."""

    KEY = "key"  #: part of the primary key: equal on both sides
    SUM = "sum"
    MIN = "min"
    MAX = "max"
    #: A sum that is NULL only while no contribution had a value.
    NULLABLE_SUM = "nullable_sum"
    #: The newest value (host, version: what the rank says now).
    LAST = "last"
    #: The newest non-NULL value (a final step once known stays known).
    LAST_KNOWN = "last_known"
    #: A mean per counted step, weighted by the column named ``weight``.
    WEIGHTED_MEAN = "weighted_mean"


@dataclass(frozen=True)
class Column:
    name: str
    rule: Rule
    #: WEIGHTED_MEAN: the count column that weighs this mean.
    weight: str | None = None
    #: False: not kept by a retention rollup (too detailed for old windows).
    rolled_up: bool = True


@dataclass(frozen=True)
class Summed:
    """A table whose rows merge column by column."""

    table: Table
    columns: tuple[Column, ...]

    @property
    def name(self) -> str:
        return self.table.name

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns if c.rule is Rule.KEY)

    def column(self, name: str) -> Column:
        return next(c for c in self.columns if c.name == name)


def _cols(rule: Rule, *names: str, weight: str | None = None) -> tuple[Column, ...]:
    return tuple(Column(n, rule, weight) for n in names)


#: Each rank's latest state. Batches of one rank can arrive out of order (retries):
#: counters only grow, identity is what the rank said last.
RANKS = Summed(
    Rank.__table__,  # type: ignore[arg-type]
    (
        *_cols(Rule.KEY, "run_id", "rank"),
        *_cols(Rule.LAST, "host", "local_rank", "coords", "agent_version", "clock"),
        *_cols(Rule.MAX, "last_step", "last_seen", "dropped_windows", "dropped_steps", "profiles_through"),
        *_cols(Rule.LAST_KNOWN, "hot_path_mean_s", "send_interval_s", "final_step"),
    ),
)

#: Per-rank window summaries; the breakdown means are filled by profiler windows.
RANK_WINDOWS = Summed(
    RankWindow.__table__,  # type: ignore[arg-type]
    (
        *_cols(Rule.KEY, "run_id", "rank", "window"),
        *_cols(Rule.MIN, "first_step", "step_time_min"),
        *_cols(Rule.MAX, "last_step", "step_time_max", "wall_end"),
        *_cols(Rule.SUM, "n_steps", "step_time_sum", "data_wait_sum", "tokens_sum"),
        *_cols(Rule.NULLABLE_SUM, "padded_tokens_sum", "profiled_steps", "skew_steps"),
        *_cols(
            Rule.WEIGHTED_MEAN,
            "compute_s",
            "comm_overlapped_s",
            "comm_exposed_s",
            "idle_s",
            weight="profiled_steps",
        ),
        # The wait/transfer split is known for fewer steps (all peers must report them).
        *_cols(Rule.WEIGHTED_MEAN, "comm_wait_s", "comm_transfer_s", weight="skew_steps"),
        Column("group_transfer_s", Rule.LAST_KNOWN, rolled_up=False),
    ),
)

#: One optimizer step of the job, additive over the ranks that report it.
JOB_STEPS = Summed(
    JobStep.__table__,  # type: ignore[arg-type]
    (
        *_cols(Rule.KEY, "run_id", "step"),
        *_cols(Rule.SUM, "ranks", "token_ranks", "step_time_sum", "tokens"),
        *_cols(Rule.MAX, "step_time_max", "data_wait_max", "tag", "wall_end"),
        *_cols(Rule.NULLABLE_SUM, "padded_tokens"),
    ),
)

#: Staged collective timing, a row per rank and batch (its steps packed), keyed by the
#: batch's first step and ``sent_at``: two batches carrying a step (a restarted agent
#: sends steps again under fresh batch ids) are two rows, and the reader gives the step to
#: the later sent (``worker/inputs.py``). Rows merge only for a batch sent twice at the same
#: instant from the same step (not a retry: a retried batch id is never staged again).
STEP_TIMINGS = Summed(
    StepTiming.__table__,  # type: ignore[arg-type]
    (
        *_cols(Rule.KEY, "run_id", "rank", "first_step", "sent_at"),
        *_cols(Rule.LAST, "last_step", "step_time_s", "data_wait_s", "sync_s", "cpu_s", "runq_s"),
    ),
)
#: The packed per-step columns of ``step_timings`` (``packed.py``), in the order the
#: analysis reads them.
STEP_TIMING_VALUES = ("step_time_s", "data_wait_s", "sync_s", "cpu_s", "runq_s")

#: Each rank's latest collective counters per process group: counters only grow (a
#: batch that arrives late cannot take them back), the rest is what the rank said last.
RANK_GROUPS = Summed(
    RankGroup.__table__,  # type: ignore[arg-type]
    (
        *_cols(Rule.KEY, "run_id", "rank", "group_name"),
        *_cols(Rule.MAX, "entered", "completed", "sampled_at"),
        *_cols(Rule.LAST, "op", "since", "heartbeat", "idle_s"),
    ),
)

#: ``job_steps`` rolled up per run and bucket of steps (``rollups.py``): each column is
#: its rule applied to one per-step value over the bucket's usable steps, and buckets
#: merge into coarser ones (series points, the run's totals) by the same rule.
JOB_STEP_BUCKETS = Summed(
    JobStepBucket.__table__,  # type: ignore[arg-type]
    (
        *_cols(Rule.KEY, "run_id", "bucket"),
        *_cols(Rule.SUM, "n_steps", "tokens_est", "tokens"),
        Column("first_step", Rule.MIN),
        Column("last_step", Rule.MAX),
        *(
            Column(f"{value}_{part}", rule)
            for value in ("step_time", "slowest", "data_wait", "tokens_per_s", "ranks")
            for part, rule in (("sum", Rule.SUM), ("min", Rule.MIN), ("max", Rule.MAX))
        ),
        Column("padded_tokens", Rule.NULLABLE_SUM),
        *_cols(Rule.SUM, "untagged_steps", "untagged_step_time", "untagged_tokens_est", "untagged_data_wait"),
    ),
)

LINK_SAMPLES = Summed(
    LinkSample.__table__,  # type: ignore[arg-type]
    (
        *_cols(Rule.KEY, "run_id", "rank", "step", "local_ep", "peer_ep"),
        *_cols(Rule.LAST, "bytes_sent", "bytes_received", "busy_s", "steps"),
    ),
)

#: The breakdown parts a profiler window measures per step, as ``rank_windows`` keeps them.
BREAKDOWN = tuple(c.name for c in RANK_WINDOWS.columns if c.weight == "profiled_steps")
#: The wait/transfer split, filled once all ranks reported a window.
SKEW = tuple(c.name for c in RANK_WINDOWS.columns if c.weight == "skew_steps")

#: Column name -> values: a list (``ranks``) or a numpy array (masked where NULL).
Columns = dict[str, Any]


@dataclass(frozen=True)
class Rows:
    """Column-oriented rows for the summed tables, one row per key, sorted by key: numpy
    arrays for the step-derived tables (sent to PostgreSQL in binary), lists for ``ranks``.
    ``step_timings``, ``link_samples`` and ``rank_groups`` are empty for batches without a
    ``comm`` section (``link_samples`` also without its ``links``)."""

    ranks: Columns
    windows: Columns
    job_steps: Columns
    step_timings: Columns = field(default_factory=dict)
    link_samples: Columns = field(default_factory=dict)
    rank_groups: Columns = field(default_factory=dict)

    def tables(self) -> tuple[tuple[Summed, Columns], ...]:
        """The tables in the order every writer takes them (so writers cannot deadlock)."""
        return (
            (RANKS, self.ranks),
            (RANK_WINDOWS, self.windows),
            (JOB_STEPS, self.job_steps),
            (STEP_TIMINGS, self.step_timings),
            (LINK_SAMPLES, self.link_samples),
            (RANK_GROUPS, self.rank_groups),
        )


# -- the step -> window rule ----------------------------------------------------------
@overload
def window_of(step: int, window_steps: int) -> int: ...
@overload
def window_of(step: npt.NDArray[np.int64], window_steps: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]: ...
def window_of(step: Any, window_steps: Any) -> Any:
    """The rank-window index of a step: window ``w`` holds steps ``w*n+1 .. (w+1)*n``
    (step 0, before the first optimizer step, belongs to window 0)."""
    if isinstance(step, np.ndarray):
        return (np.maximum(step, 1) - 1) // window_steps
    return (max(int(step), 1) - 1) // int(window_steps)


def steps_of(window: int, window_steps: int) -> tuple[int, int]:
    """The first and last step of a rank window: the steps :func:`window_of` puts in it."""
    return (window * window_steps + 1 if window > 0 else 0), (window + 1) * window_steps


# -- numpy (the fold) -----------------------------------------------------------------
def reduce(rule: Rule, values: npt.NDArray[Any], first_idx: npt.NDArray[np.intp]) -> npt.NDArray[Any]:
    """Fold ``values`` (sorted by key) over each run of equal keys starting at
    ``first_idx``. NULLABLE_SUM takes a masked array (masked = NULL)."""
    if rule is Rule.KEY:
        return values[first_idx]
    if rule is Rule.SUM:
        return np.add.reduceat(values, first_idx)
    if rule is Rule.MIN:
        return np.minimum.reduceat(values, first_idx)
    if rule is Rule.MAX:
        return np.maximum.reduceat(values, first_idx)
    if rule is Rule.NULLABLE_SUM:
        present = ~np.ma.getmaskarray(values)
        sums = np.add.reduceat(np.ma.filled(values, 0), first_idx)
        return np.ma.array(sums, mask=~np.logical_or.reduceat(present, first_idx))
    raise ValueError(f"no numpy fold for {rule}")


def fold_table(
    table: Summed,
    sources: Mapping[str, npt.NDArray[Any]],
    order: npt.NDArray[np.intp],
    first_idx: npt.NDArray[np.intp],
) -> Columns:
    """One row per key: each column of ``sources`` (per step, unsorted) reduced by its rule."""
    return {
        name: reduce(table.column(name).rule, values[order], first_idx) for name, values in sources.items()
    }


# -- Python values (the fold of ``ranks``) ----------------------------------------------
def merge_value(rule: Rule, old: Any, new: Any) -> Any:
    """``new`` merged into ``old`` as an upsert would; ``new`` arrived later."""
    if rule is Rule.MAX:
        return new if old is None else old if new is None else max(old, new)
    if rule is Rule.LAST_KNOWN:
        return old if new is None else new
    if rule in (Rule.KEY, Rule.LAST):
        return new
    raise ValueError(f"no value merge for {rule}")


# -- SQL ------------------------------------------------------------------------------
class SqlFunctions(NamedTuple):
    """The two-argument extremes, which the backends spell differently."""

    least: str
    greatest: str


def quote(name: str) -> str:
    return f'"{name}"'


def merge_sql(table: Summed, name: str, old: str, new: str, fn: SqlFunctions) -> str:
    """The SQL expression for column ``name`` of the merged row, from the stored row
    (qualifier ``old``) and the arriving one (``new``, e.g. ``excluded``). SQL evaluates
    every SET expression against the row as it was, on both backends."""
    col = table.column(name)
    o, n = f"{old}.{quote(name)}", f"{new}.{quote(name)}"
    if col.rule in (Rule.SUM, Rule.NULLABLE_SUM):
        limit = _limit(table.table.c[name].type)
        total = (
            f"{o} + {n}"
            if limit is None
            else f"CASE WHEN {o} > {limit} - {n} THEN {limit} ELSE {o} + {n} END"
        )
        return total if col.rule is Rule.SUM else f"coalesce({total}, {o}, {n})"
    if col.rule in (Rule.MIN, Rule.MAX):
        both = f"{fn.least if col.rule is Rule.MIN else fn.greatest}({o}, {n})"
        # SQLite's two-argument min/max is NULL if either is; PostgreSQL's ignores NULLs.
        return f"coalesce({both}, {o}, {n})" if table.table.c[name].nullable else both
    if col.rule is Rule.LAST:
        return n
    if col.rule is Rule.LAST_KNOWN:
        return f"coalesce({n}, {o})"
    if col.rule is Rule.WEIGHTED_MEAN:
        assert col.weight is not None
        ow, nw = f"coalesce({old}.{quote(col.weight)}, 0)", f"coalesce({new}.{quote(col.weight)}, 0)"
        return (
            f"CASE WHEN {n} IS NULL THEN {o} WHEN {o} IS NULL THEN {n} "
            f"ELSE ({o} * {ow} + {n} * {nw}) / nullif({ow} + {nw}, 0) END"
        )
    raise ValueError(f"{name} is a key")


def _limit(sql_type: Any) -> int | None:
    """The largest value of an integer column: additive merges saturate there instead of
    failing the batch with an overflow (duplicated steps sent under fresh batch ids add
    up); both sides are non-negative."""
    if isinstance(sql_type, BigInteger):
        return INT64_MAX
    if isinstance(sql_type, Integer):
        return INT32_MAX
    return None


def set_clause(table: Summed, names: Sequence[str], old: str, new: str, fn: SqlFunctions) -> str:
    """``col = <merge>, ...`` for the non-key columns among ``names``."""
    return ",\n".join(
        f"{quote(n)} = {merge_sql(table, n, old, new, fn)}"
        for n in names
        if table.column(n).rule is not Rule.KEY
    )


def aggregate_sql(table: Summed, name: str) -> str:
    """The ``GROUP BY`` aggregate of column ``name`` (NULLs ignored as the merge ignores them)."""
    col = table.column(name)
    c = quote(name)
    if col.rule in (Rule.SUM, Rule.NULLABLE_SUM):
        return f"sum({c})"
    if col.rule is Rule.MIN:
        return f"min({c})"
    if col.rule is Rule.MAX:
        return f"max({c})"
    if col.rule is Rule.WEIGHTED_MEAN:
        assert col.weight is not None
        w = quote(col.weight)
        return f"sum({c} * {w}) / nullif(sum(CASE WHEN {c} IS NULL THEN 0 ELSE {w} END), 0)"
    raise ValueError(f"{name} has no aggregate ({col.rule})")


def aggregate(rule: Rule, value: ColumnElement[Any]) -> ColumnElement[Any]:
    """:func:`aggregate_sql` as a SQLAlchemy expression over any ``value`` (the rollups
    aggregate expressions over steps, not stored columns)."""
    if rule in (Rule.SUM, Rule.NULLABLE_SUM):
        return func.sum(value)
    if rule is Rule.MIN:
        return func.min(value)
    if rule is Rule.MAX:
        return func.max(value)
    raise ValueError(f"no aggregate for {rule}")


def running_means(
    names: Sequence[str], *, weight: str | None = None, prefix: str = "s_", count: str = "k"
) -> dict[str, ColumnElement[Any]]:
    """SET values that add ``:k`` steps whose values sum to ``:s_<name>`` to the running
    means ``names`` of ``rank_windows`` and to their weight column, in one atomic UPDATE:
    ``(mean * weight + sum) / (weight + k)``, NULLs counting as 0. ``weight`` overrides the
    table's weight column (the v1 summary weighs every part by ``profiled_steps``)."""
    t = RANK_WINDOWS.table
    w_name = weight or RANK_WINDOWS.column(names[0]).weight
    assert w_name is not None and all(weight or RANK_WINDOWS.column(n).weight == w_name for n in names)
    w = func.coalesce(t.c[w_name], 0)
    k: ColumnElement[Any] = bindparam(count)
    values: dict[str, ColumnElement[Any]] = {w_name: w + k}
    for n in names:
        values[n] = (func.coalesce(t.c[n], 0.0) * w + bindparam(f"{prefix}{n}")) / (w + k)
    return values
