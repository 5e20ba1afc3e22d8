"""Wire schemas: the ingest payload (validated whole) and the query responses.

Pydantic lives here, at the edge, and nowhere else in the collector: ingest converts a
validated payload into plain values before storage and analysis touch it. Every bound
(array lengths, name charset, value ranges) is enforced here, so a bad batch is
rejected with a 422 naming the field and nothing of it is stored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SCHEMA_VERSION = 1
RunName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")]
HostName = Annotated[str, Field(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9._:-]+$")]
NonNeg = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
Count = Annotated[int, Field(ge=0, le=2**53)]
Tag = Literal["warmup", "checkpoint", "eval"] | None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Layout(_Strict):
    dp: int = Field(ge=1, le=1_048_576)
    tp: int = Field(default=1, ge=1, le=65_536)
    pp: int = Field(default=1, ge=1, le=65_536)
    cp: int = Field(default=1, ge=1, le=65_536)
    ep: int = Field(default=1, ge=1, le=65_536)


class RankIn(_Strict):
    rank: int = Field(ge=0, le=1_048_575)
    local_rank: int = Field(ge=0, le=65_535)
    world_size: int = Field(ge=1, le=1_048_576)
    host: HostName
    layout: Layout
    coords: dict[Literal["tp", "cp", "dp", "pp"], Annotated[int, Field(ge=0)]] = Field(default_factory=dict)
    counts_tokens: bool = True

    @model_validator(mode="after")
    def _consistent(self) -> RankIn:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")
        lay = self.layout
        if lay.dp * lay.tp * lay.pp * lay.cp != self.world_size:
            raise ValueError(
                f"layout dp*tp*pp*cp = {lay.dp * lay.tp * lay.pp * lay.cp} does not equal "
                f"world_size {self.world_size}"
            )
        return self


class AgentIn(_Strict):
    version: str = Field(max_length=32)
    clock: Literal["host", "cuda_events"] = "host"
    dropped_windows: Count = 0
    dropped_steps: Count = 0
    hot_path_mean_s: NonNeg | None = None


class ConventionIn(BaseModel):
    """The FLOPs convention. Extra keys are kept (the agent may add provenance fields)."""

    model_config = ConfigDict(extra="allow")

    formula: str = Field(max_length=64)
    flops_per_token: float = Field(gt=0, allow_inf_nan=False)
    hfu_flops_per_token: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    dtype: str = Field(max_length=16)
    peak_flops: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    peak_source: str | None = Field(default=None, max_length=256)
    device_name: str | None = Field(default=None, max_length=128)
    id: str | None = Field(default=None, max_length=512)


class StepsIn(_Strict):
    first: int = Field(ge=0, le=2**53)
    time_s: list[NonNeg] = Field(min_length=1)
    data_wait_s: list[NonNeg]
    tokens: list[Count]
    padded_tokens: list[Count] | None = None
    tags: list[Tag] | None = None
    wall_end: float = Field(gt=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _same_length(self) -> StepsIn:
        n = len(self.time_s)
        for name in ("data_wait_s", "tokens", "padded_tokens", "tags"):
            values = getattr(self, name)
            if values is not None and len(values) != n:
                raise ValueError(f"steps.{name} has {len(values)} values but steps.time_s has {n}")
        return self


class IngestPayload(_Strict):
    schema_version: Literal[1]
    batch_id: str = Field(pattern=r"^[A-Za-z0-9_-]{8,64}$")
    run: RunName
    sent_at: float = Field(gt=0, allow_inf_nan=False)
    agent: AgentIn
    rank: RankIn
    convention: ConventionIn | None = None
    steps: StepsIn


class IngestResult(BaseModel):
    batch_id: str
    stored: bool = Field(description="False when this batch id was already stored (a retry)")
    steps: int


class RunSummary(BaseModel):
    name: str
    world_size: int
    ranks_reporting: int
    last_step: int | None
    last_seen: float | None = Field(description="Unix time of the latest step reported by any rank")


class Stat(BaseModel):
    latest: float | None = Field(description="Mean over the most recent complete steps")
    mean: float | None = Field(description="Over all complete steps that are not tagged (warm-up etc.)")


class RunOverview(BaseModel):
    name: str
    world_size: int
    layout: dict[str, int]
    window_steps: int
    convention: dict[str, Any] | None
    ranks_reporting: int
    first_step: int | None
    last_step: int | None
    steps_stored: int
    tokens_total: int
    step_time_s: Stat
    tokens_per_s: Stat
    mfu: Stat
    data_wait_s: Stat
    padding_ratio: float | None


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


class Problem(BaseModel):
    """Error body: ``detail`` says what is wrong; ``errors`` lists each field for 422."""

    detail: str
    errors: list[dict[str, Any]] | None = None


class EventOut(BaseModel):
    """A straggler, regression or hang flag, with its evidence and its cost."""

    id: int
    key: str
    kind: Literal["straggler", "regression", "hang"]
    cause: Literal["compute", "link", "data", "host"] | None
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
