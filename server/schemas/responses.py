"""The API's responses: what the read endpoints (and the ingest answer) return.

Plain models, no validation beyond their types: the collector builds them from stored
rows (``reads/``); the OpenAPI document names every field.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from stepwatch import wire

from ..analysis.types import Cause
from ..reads.status import RunStatus


class IngestResult(BaseModel):
    batch_id: str
    stored: bool = Field(description="False when this batch id was already stored (a retry)")
    steps: int
    directives: list[dict[str, Any]] | None = Field(
        default=None,
        description="What the collector asks of this rank (captures, live settings; "
        "stepwatch.wire's steering contract), left out when nothing",
    )


class IngestBatchesResult(BaseModel):
    """One result per entry of a host batch, in the order posted."""

    results: list[IngestResult]


class RunSummary(BaseModel):
    name: str
    world_size: int
    ranks_reporting: int
    last_step: int | None
    last_seen: datetime | None = Field(description="ISO-8601 UTC time of the latest step any rank reported")
    status: RunStatus = Field(
        description="live, finished (every rank sent its final batch), stalled (no step for longer than "
        "the hang threshold) or hung (an open hang event)"
    )


class Stat(BaseModel):
    latest: float | None = Field(description="Mean over the most recent complete steps")
    mean: float | None = Field(description="Over all complete steps that are not tagged (warm-up etc.)")


class PlanOut(BaseModel):
    """The run's plan as ``stepwatch.init`` gave it."""

    target_tokens: int | None
    deadline: float | None = Field(description="Unix seconds")
    config_fingerprint: str | None
    baseline_run: str | None


class ProgressOut(BaseModel):
    """Progress and goodput, from the analysed windows (see ``analysis``) and the live total.

    Calendar efficiency is productive step time (all steps but checkpoint and evaluation)
    over wall time since the first step started, restarts and pauses included. The
    projection is remaining tokens / current throughput / calendar efficiency; the band
    uses the p10 and p90 throughput of recent windows.
    """

    tokens_done: float
    target_tokens: int | None
    fraction_done: float | None
    tokens_per_s: float | None = Field(description="Current: untagged steps of recent windows")
    step_time_s: float | None = Field(description="Current mean step time (untagged steps)")
    tokens_per_step: float | None
    productive_s: float
    wall_s: float | None
    calendar_efficiency: float | None
    remaining_tokens: float | None
    remaining_steps: float | None
    eta_s: float | None
    finish_at: float | None = Field(description="Unix seconds")
    finish_early_at: float | None
    finish_late_at: float | None
    deadline: float | None
    required_step_time_s: float | None = Field(description="Step time that meets the deadline")
    on_track: bool | None


class AnalysisOut(BaseModel):
    """How far the analysis worker has come with this run."""

    windows_analysed: int
    analysed_through_step: int
    baseline: str = Field(description="'own' or the baseline run the regressions compare against")
    updated_at: float
    stage_imbalance: str | None = Field(description="Static pipeline-stage imbalance (efficiency)")


class RankAnswer(BaseModel):
    """One rank's latest answer to a directive."""

    rank: int
    state: str = Field(description="scheduled, done or missed (a capture); applied or refused (a config)")
    reason: str | None = None
    settings: dict[str, float] | None = Field(default=None, description="A config's settings in force")


class CaptureOut(BaseModel):
    id: int
    run: str
    first_step: int = Field(description="First profiled step, ahead of every selected rank when asked")
    steps: int
    requested_steps: int
    ranks: list[int]
    reason: str = Field(description="flag <event key> or token <name> (who asked)")
    event_id: int | None
    notes: list[str] = Field(description="What was cut to fit: shortened by the budget, ranks capped")
    estimated_cost_s: float | None = Field(description="Per rank, from the run's measured profiler windows")
    created_at: datetime
    status: Literal["pending", "done"] = Field(description="done: every rank answered or the time ran out")
    done_at: datetime | None = Field(default=None, description="When the explanation was written")
    answers: list[RankAnswer]
    traces: list[dict[str, int]] = Field(
        default_factory=list,
        description="Raw traces uploaded ({rank, size}): GET .../captures/{id}/traces/{rank} (gzipped)",
    )
    result: dict[str, Any] | None = Field(
        description="The explanation: per captured rank its breakdown, top ops and collectives, "
        "and the comparison of the subject ranks with their peers (message, findings)"
    )


class CaptureRequest(BaseModel):
    """What to capture: one rank with its peers, explicit ranks, a host, or the whole job."""

    model_config = {"extra": "forbid"}

    rank: int | None = Field(
        default=None, ge=0, description="This rank and every rank it shares a group with"
    )
    ranks: list[int] | None = Field(default=None, min_length=1, max_length=4096)
    host: str | None = Field(default=None, min_length=1, max_length=255)
    all: bool = False
    steps: int | None = Field(
        default=None, ge=1, le=wire.MAX_CAPTURE_STEPS, description="Default: STEPWATCH_CAPTURE_STEPS"
    )


class ConfigRequest(BaseModel):
    """New live settings for the run's agents (or some ranks), applied without a restart."""

    model_config = {"extra": "forbid"}

    settings: dict[str, float] = Field(description="send_interval_s, profile_every, profile_steps")
    ranks: list[int] | None = Field(default=None, min_length=1, max_length=4096)


class ConfigState(BaseModel):
    """A live config directive: what was requested, and which ranks applied it."""

    id: int
    settings: dict[str, float]
    ranks: list[int] | None = Field(description="null: every rank")
    created_at: datetime
    applied: int = Field(description="Ranks that applied it")
    pending: list[int] = Field(description="Reporting ranks that have not answered (at most 64)")
    refused: list[RankAnswer]
    in_force: dict[str, dict[str, float]] = Field(
        description="Settings in force per rank as the agents reported them (at most 64 ranks)"
    )


class RunOverview(BaseModel):
    name: str
    world_size: int
    layout: dict[str, int]
    window_steps: int
    convention: dict[str, Any] | None
    ranks_reporting: int
    ranks_finished: int = Field(description="Ranks that sent their final batch")
    status: RunStatus = Field(description="As in the run list")
    mfu_unavailable: str | None = Field(description="Why there is no MFU and what to pass (null: there is)")
    last_seen: datetime | None = Field(description="ISO-8601 UTC time of the latest step any rank reported")
    first_step: int | None
    last_step: int | None
    steps_stored: int
    tokens_total: int
    step_time_s: Stat
    tokens_per_s: Stat
    mfu: Stat
    data_wait_s: Stat
    padding_ratio: float | None
    plan: PlanOut | None = None
    progress: ProgressOut | None = None
    analysis: AnalysisOut | None = None
    config: list[ConfigState] = Field(
        default_factory=list, description="Live settings requested through the API, and applied per rank"
    )


class SeriesPoint(BaseModel):
    step_from: int
    step_to: int
    count: int
    min: float | None
    mean: float | None
    max: float | None


class Series(BaseModel):
    run: str
    metric: str
    unit: str
    points: list[SeriesPoint]
    reason: str | None = Field(
        default=None, description="Why the series cannot have points (e.g. MFU without a peak FLOP/s)"
    )


class Quantiles(BaseModel):
    """Quantiles in seconds from merged log-bucket sketches (1% relative error)."""

    count: int
    p50: float | None
    p99: float | None
    max: float | None


class CollectiveOut(BaseModel):
    op: str
    windows: int = Field(description="Profiler windows merged")
    count: int
    bytes: int | None = Field(description="Total bytes (nccl-tests convention); null when unknown")
    duration_s: Quantiles
    wait_s: Quantiles | None = Field(
        description="Waiting for the last peer to arrive; null until all peers reported"
    )
    transfer_s: Quantiles | None = Field(description="From the last arrival to the end")


class NvmlOut(BaseModel):
    gpu_uuid: str | None
    sm_clock_mhz: float | None
    power_w: float | None
    temperature_c: float | None
    throttle_reasons: list[str] | None


class ClockOut(BaseModel):
    offset_s: float | None = Field(description="Added to this rank's clock to get rank 0's")
    uncertainty_s: float | None
    method: str | None


class ProfileOut(BaseModel):
    """The rank's latest profiler window with data: means per profiled step, in seconds.

    compute (only) + comm_overlapped + comm_exposed + data_wait + idle = step.
    """

    first_step: int
    n_steps: int
    device: str | None
    step_s: float | None
    compute_s: float | None
    comm_overlapped_s: float | None
    comm_exposed_s: float | None
    data_wait_s: float | None
    idle_s: float | None
    overlap_ratio: float | None = Field(description="Overlapped / all communication (0-1)")
    comm_wait_s: float | None = Field(description="Per step, summed over collectives")
    comm_transfer_s: float | None = Field(description="Per step, summed over collectives")
    top_ops: list[dict[str, Any]] | None
    nvml: NvmlOut | None
    clock: ClockOut
    cost_s: float | None = Field(description="The window's self-measured cost")
    overhead_ratio: float | None = Field(description="cost / (period x step time)")
    profile_every: int | None


class RankSummary(BaseModel):
    rank: int
    host: str
    local_rank: int
    coords: dict[str, int]
    last_step: int
    last_seen: float
    clock: str
    dropped_windows: int
    dropped_steps: int
    hot_path_mean_s: float | None
    window: int | None
    window_first_step: int | None
    window_last_step: int | None
    step_time_s: float | None = Field(description="Mean step time of the rank's latest window")
    step_time_max_s: float | None
    data_wait_s: float | None = Field(description="Mean data-loader wait per step, latest window")
    tokens_per_s: float | None
    profile: ProfileOut | None = None
    profile_skipped: str | None = Field(
        default=None, description="Why the rank's newest profiler window has no data, if it has none"
    )
    collectives: list[CollectiveOut] = Field(
        default_factory=list, description="Per op type, merged over the newest profiled windows"
    )


class Problem(BaseModel):
    """Error body: ``detail`` says what is wrong; ``errors`` lists each field for 422."""

    detail: str
    errors: list[dict[str, Any]] | None = None


class EventOut(BaseModel):
    """A straggler, regression or hang flag, with its evidence and its cost."""

    id: int
    key: str
    kind: Literal["straggler", "regression", "hang"]
    cause: Cause | None
    ranks: list[int]
    hosts: list[str]
    first_step: int
    last_step: int
    status: Literal["open", "closed"]
    evidence: dict[str, Any]
    cost_seconds: float = Field(
        description="Seconds per step the flag costs (what-if the rank ran at its peers' median)"
    )
    cost_ratio: float = Field(description="cost_seconds as a share of step time (0-1)")
    message: str
    opened_at: float
    updated_at: float
