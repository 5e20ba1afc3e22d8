"""Tables of the collector.

Storage shape (DESIGN §7: at most 200 bytes per rank-window): a job-level per-step
series (one row per run and step, aggregated over ranks on ingest) plus per-rank window
summaries (one row per run, rank and window of ``runs.window_steps`` steps). There is no
row per rank per step: at 4,096 ranks that would be the whole database.

Constraint names follow one convention so that migrations are reproducible on every
backend (alembic's recommended naming convention).

Why more than 400 lines: every table in one metadata, which the migrations, the
column rules (``columns.py``) and the tests check against; a table's comments say why
each column is there.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    SmallInteger,
    String,
    UniqueConstraint,
    column,
    desc,
    false,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

#: Largest value of an ``Integer`` column (32-bit on PostgreSQL) and of a ``BigInteger``
#: one (64-bit on both backends). The ingest schema imports these for every field stored
#: in such a column, and additive upserts saturate at them, so a value the schema accepts
#: is always storable.
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1

# BIGINT on PostgreSQL, INTEGER on SQLite (where only INTEGER PRIMARY KEY autoincrements).
BigId = BigInteger().with_variant(Integer(), "sqlite")


def unix(value: datetime | None) -> float | None:
    """A stored timestamp as Unix seconds. Every ``DateTime`` column holds UTC; SQLite
    returns it naive, PostgreSQL aware."""
    if value is None:
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return value.timestamp()


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Run(Base):
    """One training run, keyed by the name the agent reports."""

    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    world_size: Mapped[int] = mapped_column(Integer)
    #: Data-parallel replicas: how many ranks contribute tokens to a step.
    dp_size: Mapped[int] = mapped_column(Integer)
    layout: Mapped[dict[str, Any]] = mapped_column(JSON)
    #: The FLOPs convention (formula, attention, dtype, peak and its source); MFU is only
    #: comparable between runs with the same convention.
    convention: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    #: Steps per stored rank window, fixed at the run's first batch that shows its pace
    #: (``ingest/store.py``: ``pace_is_known``).
    window_steps: Mapped[int] = mapped_column(Integer)
    #: True while ``window_steps`` is a placeholder: every batch so far was a heartbeat or
    #: the first step alone. The analysis waits for the settled size.
    window_provisional: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    #: Name of the write token that created the run (null: writes were open); runs per
    #: token are limited (``STEPWATCH_MAX_RUNS_PER_TOKEN``).
    created_by: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    # The plan, from ``stepwatch.init`` (all optional): progress and the finish date are
    # projected against it; regressions compare with ``baseline_run`` when the
    # fingerprints match.
    target_tokens: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    #: Collector-clock time of the run's newest stored batch (to the second): /metrics
    #: exports the most recently reporting runs with one index range.
    last_report_at: Mapped[datetime | None] = mapped_column(
        DateTime(timezone=True), nullable=True, index=True
    )
    deadline: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    config_fingerprint: Mapped[str | None] = mapped_column(String(128), nullable=True)
    baseline_run: Mapped[str | None] = mapped_column(String(128), nullable=True)


class Rank(Base):
    """Latest state of one rank of a run (updated by that rank's batches only)."""

    __tablename__ = "ranks"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    host: Mapped[str] = mapped_column(String(255))
    local_rank: Mapped[int] = mapped_column(Integer)
    coords: Mapped[dict[str, Any]] = mapped_column(JSON)
    last_step: Mapped[int] = mapped_column(BigInteger)
    last_seen: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    agent_version: Mapped[str] = mapped_column(String(32))
    clock: Mapped[str] = mapped_column(String(16))
    dropped_windows: Mapped[int] = mapped_column(BigInteger, default=0)
    dropped_steps: Mapped[int] = mapped_column(BigInteger, default=0)
    hot_path_mean_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    #: The rank's send interval in force (a live setting): how far ahead a capture starts.
    send_interval_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    #: Last step of the rank's final batch (sent by ``close()``). The rank finished, and
    #: is no hang, while ``final_step >= last_step``; a restart that steps further clears it.
    final_step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    #: The rank owes no profiler entry of a window starting at or before this step (the
    #: newest ``steps.profiles_through`` it sent): the analysis compares a window's ranks
    #: once their profiles are in. NULL while it sent none (no profiler, an older agent):
    #: nothing to wait for.
    profiles_through: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class RankWindow(Base):
    """Summary of ``window_steps`` consecutive steps of one rank. Mergeable columns only
    (counts, sums, minima, maxima) so that a window split over two batches adds up."""

    __tablename__ = "rank_windows"

    #: No foreign key: checked per inserted row, a row per rank-window (migration 0022).
    run_id: Mapped[int] = mapped_column(BigId, primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    window: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    first_step: Mapped[int] = mapped_column(BigInteger)
    last_step: Mapped[int] = mapped_column(BigInteger)
    n_steps: Mapped[int] = mapped_column(Integer)
    step_time_sum: Mapped[float] = mapped_column(Float)
    step_time_min: Mapped[float] = mapped_column(Float)
    step_time_max: Mapped[float] = mapped_column(Float)
    data_wait_sum: Mapped[float] = mapped_column(Float)
    tokens_sum: Mapped[int] = mapped_column(BigInteger)
    padded_tokens_sum: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    wall_end: Mapped[float] = mapped_column(Float)
    # Time breakdown from the profiler window, when one fell inside this window: means
    # per profiled step, in seconds (null otherwise). Filled by the profiler-window work.
    profiled_steps: Mapped[int | None] = mapped_column(Integer, nullable=True)
    compute_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    comm_overlapped_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    comm_exposed_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    idle_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    #: Per step, summed over collectives: waiting for the last peer / moving data after it.
    comm_wait_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    comm_transfer_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    #: Transfer time per communicator type (``{"dp": s, "tp": s, "pp": s}``) when the
    #: agent reports it: intersecting slow groups names the rank on a slow link.
    group_transfer_s: Mapped[dict[str, float] | None] = mapped_column(JSON, nullable=True)

    #: Profiled steps whose wait/transfer split is known (all peers reported them): the
    #: weight of the running means ``comm_wait_s`` / ``comm_transfer_s``.
    skew_steps: Mapped[int | None] = mapped_column(Integer, nullable=True)

    # /metrics reads one or two windows of a run (every rank's row of that window) and the
    # newest profiled window; without these, both scan every window the run ever stored.
    # The profiled rows are ordered by compute time (largest first, ties to the lower
    # rank), so the top-K slowest ranks are the index's first K entries (migration 0014).
    __table_args__ = (
        Index(None, "run_id", "window"),
        Index(
            "ix_rank_windows_profiled",
            "run_id",
            "window",
            desc(column("compute_s")),
            "rank",
            postgresql_where=text("profiled_steps IS NOT NULL"),
            sqlite_where=text("profiled_steps IS NOT NULL"),
        ),
    )


class ProfileWindow(Base):
    """One profiler window of one rank: the detail behind the means in ``rank_windows``.

    One row per rank per profiled window (every ``profile_every`` steps), so it does not
    count against the per-rank-window budget. ``skipped`` says why a window has no data
    (another profiler was active, ...). Breakdown parts are means per profiled step.
    """

    __tablename__ = "profile_windows"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    first_step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    window: Mapped[int] = mapped_column(BigInteger)
    n_steps: Mapped[int] = mapped_column(Integer)
    device: Mapped[str | None] = mapped_column(String(8), nullable=True)
    skipped: Mapped[str | None] = mapped_column(String(128), nullable=True)
    step_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    compute_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    comm_overlapped_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    comm_exposed_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    data_wait_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    idle_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    top_ops: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, nullable=True)
    gpu_uuid: Mapped[str | None] = mapped_column(String(64), nullable=True)
    sm_clock_mhz: Mapped[float | None] = mapped_column(Float, nullable=True)
    power_w: Mapped[float | None] = mapped_column(Float, nullable=True)
    temperature_c: Mapped[float | None] = mapped_column(Float, nullable=True)
    throttle_reasons: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)
    clock_offset_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    clock_uncertainty_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    clock_method: Mapped[str | None] = mapped_column(String(16), nullable=True)
    cost_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    overhead_ratio: Mapped[float | None] = mapped_column(Float, nullable=True)
    profile_every: Mapped[int | None] = mapped_column(Integer, nullable=True)
    wall_end: Mapped[float] = mapped_column(Float)


class CollectiveStat(Base):
    """Per rank, profiler window and operation type: count, bytes and three sketches.

    ``duration`` comes with the rank's own batch; ``wait`` and ``transfer`` are filled
    once every peer has reported the window (``profile_pending``). Sketches are
    :class:`stepwatch.sketch.LogSketch` dicts; quantiles are computed at query time from
    merged sketches.
    """

    __tablename__ = "collective_stats"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    first_step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    op: Mapped[str] = mapped_column(String(16), primary_key=True)
    window: Mapped[int] = mapped_column(BigInteger)
    count: Mapped[int] = mapped_column(Integer)
    bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    duration: Mapped[dict[str, Any]] = mapped_column(JSON)
    wait: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    transfer: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class ProfilePending(Base):
    """A profiler window some ranks have reported: ``arrivals`` counts them. The row lock
    taken by its increment serialises the ranks, so exactly one ingest sees the count
    reach the world size and splits wait from transfer for everyone."""

    __tablename__ = "profile_pending"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    first_step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    arrivals: Mapped[int] = mapped_column(Integer)


class ProfileArrival(Base):
    """One rank's collective enter/end times for a pending window (deleted once used)."""

    __tablename__ = "profile_arrivals"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    first_step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    data: Mapped[dict[str, Any]] = mapped_column(JSON)


class JobStep(Base):
    """One optimizer step of the whole job, aggregated over the ranks that reported it."""

    __tablename__ = "job_steps"
    # Merged by every group that carries the step: half of each page free for HOT
    # updates, pruned as read (0012, ``storage/postgres.py``). An index on a column that
    # ingest updates (wall_end, tokens, ...) would make every update non-HOT.
    __table_args__ = ({"postgresql_with": {"fillfactor": 50}},)

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    ranks: Mapped[int] = mapped_column(Integer)
    token_ranks: Mapped[int] = mapped_column(Integer)
    step_time_sum: Mapped[float] = mapped_column(Float)
    step_time_max: Mapped[float] = mapped_column(Float)
    data_wait_max: Mapped[float] = mapped_column(Float)
    tokens: Mapped[int] = mapped_column(BigInteger)
    padded_tokens: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    #: 0 = none, else an index into stepwatch's TAGS (warmup, checkpoint, eval).
    tag: Mapped[int] = mapped_column(SmallInteger)
    wall_end: Mapped[float] = mapped_column(Float)


class JobStepBucket(Base):
    """``job_steps`` rolled up per run into buckets of ``rollups.BUCKET_STEPS`` steps.

    Ingest recomputes the buckets a group touched from their steps in the same
    transaction (``storage/rollups.py``), so the overview and a long series read one row
    per bucket instead of one per step (a month of 10 s steps is 259,200 steps, 4,050
    buckets). Only usable steps count (tokens reported, positive step time), as in the
    readers. Per series value: the sum, minimum and maximum over the bucket's steps.
    Retention keeps ``job_steps``, so buckets are never rolled up or pruned.
    """

    __tablename__ = "job_step_buckets"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    bucket: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    n_steps: Mapped[int] = mapped_column(Integer)
    first_step: Mapped[int] = mapped_column(BigInteger)
    last_step: Mapped[int] = mapped_column(BigInteger)
    step_time_sum: Mapped[float] = mapped_column(Float)
    step_time_min: Mapped[float] = mapped_column(Float)
    step_time_max: Mapped[float] = mapped_column(Float)
    slowest_sum: Mapped[float] = mapped_column(Float)
    slowest_min: Mapped[float] = mapped_column(Float)
    slowest_max: Mapped[float] = mapped_column(Float)
    data_wait_sum: Mapped[float] = mapped_column(Float)
    data_wait_min: Mapped[float] = mapped_column(Float)
    data_wait_max: Mapped[float] = mapped_column(Float)
    tokens_per_s_sum: Mapped[float] = mapped_column(Float)
    tokens_per_s_min: Mapped[float] = mapped_column(Float)
    tokens_per_s_max: Mapped[float] = mapped_column(Float)
    ranks_sum: Mapped[float] = mapped_column(Float)
    ranks_min: Mapped[float] = mapped_column(Float)
    ranks_max: Mapped[float] = mapped_column(Float)
    #: Global tokens estimated per step (scaled to all replicas), summed.
    tokens_est: Mapped[float] = mapped_column(Float)
    tokens: Mapped[float] = mapped_column(Float)
    padded_tokens: Mapped[float | None] = mapped_column(Float, nullable=True)
    #: The same over the untagged (steady) steps only: the overview's means.
    untagged_steps: Mapped[int] = mapped_column(Integer)
    untagged_step_time: Mapped[float] = mapped_column(Float)
    untagged_tokens_est: Mapped[float] = mapped_column(Float)
    untagged_data_wait: Mapped[float] = mapped_column(Float)


class StepTiming(Base):
    """Staging of the always-on collective timing (the agent's ``comm`` section), one row
    per rank and batch, its steps packed (``packed.py``: one float64 per step, NaN where
    unknown), until the worker has analysed the windows of its steps: the late-arrival
    detectors pair ranks step by step, which a window's sums cannot do. The worker deletes
    the rows whose last step it has analysed, so the table holds a few batches per rank.
    A row per rank and step was most of ingest's rows with a DDP model (migration 0021)."""

    __tablename__ = "step_timings"
    #: A 64-step batch is about 2.6 KB: kept in the row up to 8 KB (PostgreSQL moves a
    #: row over 2 KB into TOAST by default, a second table and index written per row).
    __table_args__ = ({"postgresql_with": {"toast_tuple_target": 8160}},)

    #: No foreign key, as in ``link_samples``: checked per inserted row, it made writing
    #: the staged rows three times slower (migration 0018); ingest writes them only in the
    #: transaction that claims a batch of an existing run.
    run_id: Mapped[int] = mapped_column(BigId, primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    first_step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    #: The agent's ``sent_at``: where two of a rank's batches carry a step (an agent
    #: restarted from a checkpoint sends steps again under new batch ids), the one sent
    #: later holds it (the agent's clock, not the order of arrival: a stale batch whose
    #: retries came through late does not overwrite the fresh one).
    sent_at: Mapped[float] = mapped_column(Float, primary_key=True)
    last_step: Mapped[int] = mapped_column(BigInteger)
    step_time_s: Mapped[bytes] = mapped_column(LargeBinary)
    data_wait_s: Mapped[bytes] = mapped_column(LargeBinary)
    #: End minus arrival of the step's last bucket, plus the step's wait in DDP's buffer
    #: broadcast (``comm.broadcast_s``): the step's wait for peers (NaN: no collective).
    sync_s: Mapped[bytes] = mapped_column(LargeBinary)
    #: Training-thread CPU time of the step (NaN: not measured).
    cpu_s: Mapped[bytes] = mapped_column(LargeBinary)
    #: Training-thread run-queue wait: the window's, shared in proportion to step time.
    runq_s: Mapped[bytes] = mapped_column(LargeBinary)


class RankGroup(Base):
    """Each rank's latest collective counters per process group (the agent's
    ``comm.groups``): how many collectives it entered and completed, and the op and entry
    time of the one it is in. When a run stops stepping, the hang detector compares them
    across the ranks of a group: who never entered collective #N, who waits in it."""

    __tablename__ = "rank_groups"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    group_name: Mapped[str] = mapped_column(String(128), primary_key=True)
    entered: Mapped[int] = mapped_column(BigInteger)
    completed: Mapped[int] = mapped_column(BigInteger)
    op: Mapped[str | None] = mapped_column(String(16), nullable=True)
    #: Unix seconds at which the rank entered that collective.
    since: Mapped[float | None] = mapped_column(Float, nullable=True)
    #: The agent's ``sent_at`` of the batch that carried the counters.
    sampled_at: Mapped[float] = mapped_column(Float)
    #: 1 when they came with a heartbeat (the rank had closed no window for a while).
    heartbeat: Mapped[int] = mapped_column(SmallInteger)
    #: A heartbeat's seconds since the rank's last step ended, when they were read.
    idle_s: Mapped[float | None] = mapped_column(Float, nullable=True)


class LinkSample(Base):
    """Staging of the per-connection link timing (the ``comm`` section's ``links``), one
    row per rank, batch (its last step) and connection, until the worker has analysed
    the window: the link detector joins both ends of each connection across ranks. The
    worker deletes the rows of the windows it analysed (``worker/outputs.py``)."""

    __tablename__ = "link_samples"

    #: No foreign key (``step_timings``' reason).
    run_id: Mapped[int] = mapped_column(BigId, primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    #: Hashes of ``address:port`` of this end and the peer's end (the same at both ends).
    local_ep: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    peer_ep: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    bytes_sent: Mapped[int] = mapped_column(BigInteger)
    bytes_received: Mapped[int] = mapped_column(BigInteger)
    #: Seconds with data in flight, not limited by the receiver's window.
    busy_s: Mapped[float] = mapped_column(Float)
    #: Steps of the batch (bytes per step compare connections of the same collective).
    steps: Mapped[int] = mapped_column(Integer)


class IngestedBatch(Base):
    """Batch ids already stored: a retried batch is acknowledged but not stored twice.
    Scoped by run: one run's writer cannot make another run's batch look like a retry."""

    __tablename__ = "ingested_batches"

    #: No foreign key: checked per inserted row, a row per rank-window (migration 0022).
    run_id: Mapped[int] = mapped_column(BigId, primary_key=True)
    batch_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer)
    received_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))

    __table_args__ = (Index(None, "run_id", "received_at"),)


class TokenQuota(Base):
    """Runs a write token has created (``''``: writes without a token), so that admitting
    a new run reads and increments one row under its lock (``ingest/admission.py``)
    instead of counting the token's runs."""

    __tablename__ = "token_quotas"

    token: Mapped[str] = mapped_column(String(64), primary_key=True)
    runs_created: Mapped[int] = mapped_column(Integer)


class Event(Base):
    """A straggler, regression or hang flag: opened, updated as it persists, closed.

    ``key`` names what is flagged (``straggler:compute:rank=2``, ``regression:mfu``,
    ``hang:run``); ``(run_id, key, first_step)`` identifies one occurrence, so detectors
    upsert a flag as it moves from open to closed and a replayed window changes nothing.
    """

    __tablename__ = "events"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    key: Mapped[str] = mapped_column(String(128))
    kind: Mapped[str] = mapped_column(String(16))
    cause: Mapped[str | None] = mapped_column(String(16), nullable=True)
    ranks: Mapped[list[int]] = mapped_column(JSON)
    hosts: Mapped[list[str]] = mapped_column(JSON)
    first_step: Mapped[int] = mapped_column(BigInteger)
    last_step: Mapped[int] = mapped_column(BigInteger)
    status: Mapped[str] = mapped_column(String(8))
    evidence: Mapped[dict[str, Any]] = mapped_column(JSON)
    cost_seconds: Mapped[float] = mapped_column(Float)
    cost_ratio: Mapped[float] = mapped_column(Float)
    message: Mapped[str] = mapped_column(String(1024))
    opened_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))

    __table_args__ = (
        UniqueConstraint("run_id", "key", "first_step"),
        Index(None, "run_id", "status"),
    )


class Directive(Base):
    """A request to some ranks of a run, delivered in the answers to their batches
    (``stepwatch.wire``'s steering contract): a capture or new live settings.

    ``ranks`` null means every rank. A directive is delivered to a targeted rank until
    that rank acknowledges it or ``expires_at`` passes (a capture: soon after its steps; a
    config: when a newer config of the run replaces it). ``result`` is a capture's
    explanation once every targeted rank answered (``worker/captures.py``).
    """

    __tablename__ = "directives"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(8))
    ranks: Mapped[list[int] | None] = mapped_column(JSON, nullable=True)
    params: Mapped[dict[str, Any]] = mapped_column(JSON)
    #: Who or what asked: ``flag <event key>`` or ``token <name>`` / ``open``.
    reason: Mapped[str] = mapped_column(String(256))
    #: The flag whose opening asked for this capture (its evidence gets the explanation).
    event_id: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    done_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)

    __table_args__ = (Index(None, "run_id", "expires_at"),)


class DirectiveAck(Base):
    """One rank's answer to a directive: its latest state (``wire.AckState``, or ``done``
    when a capture's profiler entry arrived) and, for a config, the settings in force."""

    __tablename__ = "directive_acks"

    directive_id: Mapped[int] = mapped_column(
        ForeignKey("directives.id", ondelete="CASCADE"), primary_key=True
    )
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    state: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(String(200), nullable=True)
    settings: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    #: A capture's profiled steps on this rank (its ``profile_windows`` row).
    first_step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class CaptureTrace(Base):
    """The raw torch.profiler trace (gzipped Chrome JSON) of a capture's subject rank,
    uploaded by that rank when asked, under the collector's size cap; deleted by
    ``stepwatch db prune`` after its retention. The explanation never needs it: it is for
    the person who wants to open the trace in Perfetto."""

    __tablename__ = "capture_traces"

    directive_id: Mapped[int] = mapped_column(
        ForeignKey("directives.id", ondelete="CASCADE"), primary_key=True
    )
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)
    size: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)


class AnalysisState(Base):
    """Where the analysis of a run stands, so that any collector replica can continue it.

    ``next_window`` is the first rank window not yet analysed; ``state`` is the detectors'
    JSON state (:class:`stepwatch_server.analysis.pipeline.RunAnalysis`); ``pending`` maps
    a window that is incomplete but already passed by newer data to the time a collector
    first saw it so (collector clock), for the grace period. ``version`` grows with every
    pass, and a pass writes only over the version it read (no lost update).
    """

    __tablename__ = "analysis_state"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    version: Mapped[int] = mapped_column(BigInteger)
    next_window: Mapped[int] = mapped_column(BigInteger)
    state: Mapped[dict[str, Any]] = mapped_column(JSON)
    pending: Mapped[dict[str, Any]] = mapped_column(JSON)
    #: ``own`` (the run's post-warm-up baseline) or the name of the baseline run used.
    baseline_source: Mapped[str] = mapped_column(String(160))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class WindowSummary(Base):
    """What ``/metrics`` reports of one window across all of a run's ranks, computed once
    by the analysis worker when it analyses the window (:mod:`stepwatch_server.exporter.summaries`).

    Without it every scrape of a running job passed over every rank's row of the newest
    complete window (and of the newest profiled one) to compute the same quantiles again.
    ``kind`` is ``census`` (step time and data wait, the slowest ranks by step time) or
    ``profiled`` (the breakdown, compute and collective-wait quantiles, the slowest ranks
    by compute); each run keeps only its newest row of each kind. ``steps`` and
    ``rank_steps`` are the window's signature in ``job_steps`` when it was read: a rank
    that stores a step of the window later changes it, and the exporter then reads the
    window again instead of this row. Profiler entries store no step: the worker writes
    a ``profiled`` row only once every rank's entries for the window are in.
    """

    __tablename__ = "window_summaries"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16), primary_key=True)
    window: Mapped[int] = mapped_column(BigInteger)
    steps: Mapped[int] = mapped_column(BigInteger)
    rank_steps: Mapped[int] = mapped_column(BigInteger)
    summary: Mapped[dict[str, Any]] = mapped_column(JSON)
