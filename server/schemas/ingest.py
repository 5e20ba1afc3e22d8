"""The ingest payload, validated whole at the edge.

Pydantic lives here (and in ``responses.py``), at the edge, and nowhere else in the
collector: ingest converts a validated payload into plain values before storage and
analysis touch it. Every bound (array lengths, name charset, value ranges) is enforced here, so a bad batch is
rejected with a 422 naming the field and nothing of it is stored.

Longer than the usual module: the payload is one document and its cross-field rules
(steps against comm, heartbeats, profiles) are validated in one place.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import ErrorDetails

from stepwatch import wire
from stepwatch.sketch import LogSketch

from ..storage.models import INT32_MAX

RunName = Annotated[str, Field(pattern=wire.RUN_NAME_PATTERN)]
HostName = Annotated[str, Field(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9._:-]+$")]
DirectiveId = Annotated[str, Field(pattern=wire.DIRECTIVE_ID_PATTERN)]
#: Any non-negative measured quantity (seconds, counts, MHz, W); the bound keeps sums finite.
NonNeg = Annotated[float, Field(ge=0.0, le=1e12, allow_inf_nan=False)]
Count = Annotated[int, Field(ge=0, le=2**53)]


#: Below any clock's resolution: a duration under a nanosecond counts as 0.
RESOLUTION_S = 1e-9


def _resolvable(v: float) -> float:
    return 0.0 if v < RESOLUTION_S else v


def _resolved(values: list[float]) -> list[float]:
    """A list of :data:`StepSeconds` with the values under :data:`RESOLUTION_S` as 0: one
    C-level ``min`` per list, a Python pass only when some value needs it (an
    ``AfterValidator`` per element was a Python call per step, a quarter of validation)."""
    if values and min(values) < RESOLUTION_S:
        return [0.0 if v < RESOLUTION_S else v for v in values]
    return values


def _resolved_or_none(values: list[float | None]) -> list[float | None]:
    present = [v for v in values if v is not None]
    if present and min(present) < RESOLUTION_S:
        return [None if v is None else 0.0 if v < RESOLUTION_S else v for v in values]
    return values


_SECONDS_BOUNDS = Field(ge=0.0, le=1e6, allow_inf_nan=False)
#: A step or wait longer than 11 days is a broken clock; one under a nanosecond is below
#: any clock's resolution and counts as 0 (not a reason to refuse a batch). Both keep every
#: sum and rate derived from them finite.
Seconds = Annotated[float, _SECONDS_BOUNDS, AfterValidator(_resolvable)]
#: :data:`Seconds` inside a per-step list: the same bounds; the model that holds the list
#: applies the resolution rule to the whole list (``_resolved``).
StepSeconds = Annotated[float, _SECONDS_BOUNDS]
#: Tokens of one step on one rank (2**40 is about 10**12): sums over a million ranks and
#: a group of batches stay inside a 64-bit integer.
Tokens = Annotated[int, Field(ge=0, le=2**40)]
#: Unix time up to the year 9999 (what a timestamp column can hold).
UnixTime = Annotated[float, Field(gt=0, le=253_402_300_799, allow_inf_nan=False)]
#: Hard cap on one batch's steps (the configurable limit is STEPWATCH_MAX_STEPS_PER_BATCH).
MAX_STEPS = 100_000
Tag = wire.Tag | None


class _Strict(BaseModel):
    # ``strict``: JSON types are what they say. A string, float or boolean is not coerced
    # into an integer or a flag (``"0"``, ``2.0``, ``true`` for a count, ``"yes"`` for
    # ``final``); an integer is still a valid float.
    model_config = ConfigDict(extra="forbid", strict=True)


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
    coords: dict[wire.Dim, Annotated[int, Field(ge=0, le=1_048_575)]] = Field(default_factory=dict)
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
    version: str = Field(max_length=32, pattern=r"^[A-Za-z0-9._+-]+$")
    clock: wire.StepClock = "host"
    dropped_windows: Count = 0
    dropped_steps: Count = 0
    hot_path_mean_s: Seconds | None = None
    #: The send interval in force (a live setting): how far ahead a capture must start.
    send_interval_s: NonNeg | None = None
    #: The config directives this process applied or refused (``wire``'s steering
    #: contract); absent from agents older than it, which are sent what they did not ack.
    configs: list[DirectiveId] | None = Field(default=None, max_length=wire.MAX_CONFIGS_REPORTED)


class ConventionIn(BaseModel):
    """The FLOPs convention. Extra keys are kept (the agent may add provenance fields)."""

    model_config = ConfigDict(extra="allow", strict=True)

    formula: str = Field(max_length=64)
    flops_per_token: float = Field(gt=0, le=1e18, allow_inf_nan=False)
    hfu_flops_per_token: float | None = Field(default=None, gt=0, le=1e18, allow_inf_nan=False)
    dtype: str = Field(max_length=16)
    peak_flops: float | None = Field(default=None, ge=1e6, le=1e20, allow_inf_nan=False)
    peak_source: str | None = Field(default=None, max_length=256)
    device_name: str | None = Field(default=None, max_length=128)
    id: str | None = Field(default=None, max_length=512)

    @model_validator(mode="after")
    def _bounded_extras(self) -> ConventionIn:
        # Extra keys are kept with the run: bound how many and what they hold.
        extra = self.model_extra or {}
        if len(extra) > 32:
            raise ValueError(f"{len(extra)} extra convention fields; at most 32")
        for key, value in extra.items():
            if len(key) > 64:
                raise ValueError(f"extra convention field name longer than 64 characters: {key[:64]!r}...")
            if not (value is None or isinstance(value, (bool, int, float, str))):
                raise ValueError(f"extra convention field {key!r} must be a number, string, boolean or null")
            if isinstance(value, str) and len(value) > 256:
                raise ValueError(f"extra convention field {key!r} is longer than 256 characters")
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"extra convention field {key!r} must be finite")
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**53:
                raise ValueError(f"extra convention field {key!r} is out of range")
        return self


class StepsIn(_Strict):
    first: int = Field(ge=0, le=2**53)
    #: Empty only in a rank's final batch (``final: true``), which may carry no step.
    time_s: list[StepSeconds] = Field(max_length=MAX_STEPS)
    data_wait_s: list[StepSeconds] = Field(max_length=MAX_STEPS)
    tokens: list[Tokens] = Field(max_length=MAX_STEPS)
    padded_tokens: list[Tokens] | None = Field(default=None, max_length=MAX_STEPS)
    tags: list[Tag] | None = Field(default=None, max_length=MAX_STEPS)
    wall_end: UnixTime
    #: The rank owes no profiler entry of a window starting at or before this step (it was
    #: sent with this batch or an earlier one): the analysis waits for the entries still
    #: owed before it compares a window's ranks (or for its grace). Absent (a heartbeat,
    #: an agent without profiler or older): the rank's stored value stands.
    profiles_through: int | None = Field(default=None, ge=0, le=2**53)

    @model_validator(mode="after")
    def _same_length(self) -> StepsIn:
        n = len(self.time_s)
        for name in ("data_wait_s", "tokens", "padded_tokens", "tags"):
            values = getattr(self, name)
            if values is not None and len(values) != n:
                raise ValueError(f"steps.{name} has {len(values)} values but steps.time_s has {n}")
        self.time_s = _resolved(self.time_s)
        self.data_wait_s = _resolved(self.data_wait_s)
        return self


class PlanIn(_Strict):
    """Run-level plan from ``stepwatch.init`` (all optional); every rank may send it."""

    target_tokens: int | None = Field(default=None, gt=0, le=2**62)
    deadline: UnixTime | None = Field(default=None, description="Unix seconds")
    config_fingerprint: str | None = Field(default=None, pattern=wire.FINGERPRINT_PATTERN)
    baseline_run: RunName | None = None


# -- profiler windows (schema_version 2) ---------------------------------------------

MAX_PROFILES = 8
MAX_PROFILE_STEPS = 16
MAX_ARRIVALS = 4096
RelSeconds = Annotated[float, Field(ge=-1e6, le=1e6, allow_inf_nan=False)]
RankId = Annotated[int, Field(ge=0, le=1_048_575)]


def _sketch(v: dict[str, Any]) -> dict[str, Any]:
    LogSketch.check(v)  # raises ValueError naming the sketch field
    return v


class TopOpIn(_Strict):
    name: str = Field(max_length=128)
    self_s: NonNeg
    count: NonNeg


class CollectiveIn(_Strict):
    """One operation type of one window: count, bytes and a duration sketch (seconds)."""

    op: wire.CollectiveOp
    count: int = Field(ge=0, le=INT32_MAX)
    bytes: Count | None = None
    duration: dict[str, Any]

    _valid_sketch = field_validator("duration")(_sketch)

    @model_validator(mode="after")
    def _count_matches(self) -> CollectiveIn:
        if self.duration["count"] != self.count:
            raise ValueError(f"duration.count {self.duration['count']} is not count {self.count}")
        return self


class ArrivalsIn(_Strict):
    """Enter/end times (seconds after the profile's ``t0``) of one group's collectives."""

    group: str = Field(max_length=128)
    ranks: list[RankId] | None = Field(default=None, max_length=1_048_576)
    size: int | None = Field(default=None, ge=1, le=1_048_576)
    key_kind: Literal["seq", "order"]
    step: list[Annotated[int, Field(ge=0, le=2**53)]] = Field(max_length=MAX_ARRIVALS)
    op: list[wire.CollectiveOp] = Field(max_length=MAX_ARRIVALS)
    key: list[Annotated[int, Field(ge=0, le=2**53)]] = Field(max_length=MAX_ARRIVALS)
    enter: list[RelSeconds] = Field(max_length=MAX_ARRIVALS)
    end: list[RelSeconds] = Field(max_length=MAX_ARRIVALS)

    @model_validator(mode="after")
    def _same_length(self) -> ArrivalsIn:
        n = len(self.step)
        for name in ("op", "key", "enter", "end"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} values but step has {n}")
        return self


class ClockIn(_Strict):
    offset_s: RelSeconds
    uncertainty_s: NonNeg
    method: Literal["same-host", "store"]


class NvmlIn(_Strict):
    gpu_uuid: str | None = Field(default=None, max_length=64, pattern=r"^[A-Za-z0-9-]+$")
    sm_clock_mhz: NonNeg | None = None
    power_w: NonNeg | None = None
    temperature_c: float | None = Field(default=None, ge=-100, le=300, allow_inf_nan=False)
    throttle_reasons: list[Annotated[str, Field(max_length=32)]] | None = Field(default=None, max_length=16)


class CostIn(_Strict):
    """The window's self-measured cost (seconds) and the period it ran under."""

    window_s: NonNeg
    on_thread_s: NonNeg
    slowdown_s: NonNeg
    parse_cpu_s: NonNeg
    # Lasting slowdown of the steps between windows against the steps before the first
    # window (already inside window_s); optional, so older agents' entries stay valid.
    lasting_s: NonNeg = 0.0
    lasting_ratio: NonNeg | None = None
    # 0 for a capture (asked for, no period) or with the periodic window off.
    every: int = Field(ge=0, le=INT32_MAX)
    next_every: int = Field(ge=0, le=INT32_MAX)
    overhead_ratio: NonNeg | None = None


class ProfileIn(_Strict):
    """One profiler window of this rank: per-step breakdown arrays and window summaries.

    A skipped window has ``n_steps`` 0, a ``skipped`` reason and nothing else.
    """

    first_step: int = Field(ge=0, le=2**53)
    n_steps: int = Field(ge=0, le=MAX_PROFILE_STEPS)
    skipped: str | None = Field(default=None, max_length=128)
    device: Literal["cpu", "cuda"] | None = None
    t0: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    time_s: list[NonNeg] = Field(default_factory=list, max_length=MAX_PROFILE_STEPS)
    compute_s: list[NonNeg] = Field(default_factory=list, max_length=MAX_PROFILE_STEPS)
    # Copies (memcpy/memset beside no kernel) apart from compute; optional, so older
    # agents' entries stay valid. Stored inside compute_s (see _consistent).
    copy_s: list[NonNeg] | None = Field(default=None, max_length=MAX_PROFILE_STEPS)
    comm_overlapped_s: list[NonNeg] = Field(default_factory=list, max_length=MAX_PROFILE_STEPS)
    comm_exposed_s: list[NonNeg] = Field(default_factory=list, max_length=MAX_PROFILE_STEPS)
    data_wait_s: list[NonNeg] = Field(default_factory=list, max_length=MAX_PROFILE_STEPS)
    idle_s: list[NonNeg] = Field(default_factory=list, max_length=MAX_PROFILE_STEPS)
    top_ops: list[TopOpIn] = Field(default_factory=list, max_length=20)
    collectives: list[CollectiveIn] = Field(default_factory=list, max_length=16)
    arrivals: list[ArrivalsIn] = Field(default_factory=list, max_length=32)
    clock: ClockIn | None = None
    nvml: NvmlIn | None = None
    cost: CostIn | None = None
    #: The capture directive this window answers (``wire``'s steering contract).
    capture: DirectiveId | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ProfileIn:
        n = self.n_steps
        for name in ("time_s", *wire.STEP_PARTS):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} values but n_steps is {n}")
        if self.copy_s is not None:
            if len(self.copy_s) != n:
                raise ValueError(f"copy_s has {len(self.copy_s)} values but n_steps is {n}")
            # The collector has no column for copies yet: it keeps them inside compute
            # (device busy without communication), so its stored parts still sum to the step.
            self.compute_s = [c + k for c, k in zip(self.compute_s, self.copy_s, strict=True)]
            self.copy_s = None
        if n and (self.device is None or self.t0 is None):
            raise ValueError("a profile with steps needs device and t0")
        if not n and self.skipped is None:
            raise ValueError("a profile without steps must say why it was skipped")
        for j in range(n):
            parts = (
                self.compute_s[j]
                + self.comm_overlapped_s[j]
                + self.comm_exposed_s[j]
                + self.data_wait_s[j]
                + self.idle_s[j]
            )
            if abs(parts - self.time_s[j]) > 0.02 * self.time_s[j] + 1e-6:
                raise ValueError(
                    f"step {j}: the parts sum to {parts} s, not the step time {self.time_s[j]} s"
                )
        last = self.first_step + n
        for g in self.arrivals:
            if any(not self.first_step <= s < last for s in g.step):
                raise ValueError(f"arrivals of group {g.group!r} name a step outside the profiled steps")
        return self


class GroupSeqIn(_Strict):
    """Per process group: collectives this rank entered and completed so far (a hang's
    diagnosis: who never entered collective #N), and the op and entry time (Unix
    seconds) of the collective it is in (the oldest entered and not completed), or of
    the last it entered when none is in flight."""

    group: str = Field(min_length=1, max_length=128)
    entered: Count
    completed: Count
    op: wire.CollectiveOp | None = None
    since: UnixTime | None = None

    @model_validator(mode="after")
    def _ordered(self) -> GroupSeqIn:
        if self.completed > self.entered:
            raise ValueError(f"completed {self.completed} exceeds entered {self.entered}")
        return self


EndpointId = Annotated[int, Field(ge=0, lt=wire.ENDPOINT_ID_BOUND)]


class LinkIn(_Strict):
    """One TCP connection of this rank over the batch (``stepwatch._links``): endpoint ids
    (hashes of ``address:port``, the same at both ends), bytes the peer acknowledged,
    bytes received, and the seconds the connection was busy with data in flight."""

    local: EndpointId
    peer: EndpointId
    bytes: Count
    received: Count
    busy_s: Seconds


#: A per-step time of a version-2 ``comm`` section: integer microseconds, within the
#: bounds of :data:`StepSeconds`.
StepMicros = Annotated[int, Field(ge=0, le=10**12)]

#: Per-step lists of each ``comm`` version, as sent (the version-1 names in seconds):
#: the required ones, and the broadcast's wait (only where a step waited in it).
_COMM_STEP_LISTS: dict[int, tuple[str, ...]] = {
    1: ("arrive_s", "end_s", "sync_s", "cpu_s"),
    wire.COMM_VERSION: ("arrive_us", "sync_us", "cpu_us"),
}
_COMM_BROADCAST = {1: "broadcast_s", wire.COMM_VERSION: "broadcast_us"}


class CommIn(_Strict):
    """Always-on collective timing of this batch's steps (the agent's collective timing).

    Per step, after the step's start on this rank's ``clock`` (``null``: no collective in
    that step): the arrival (the step's last gradient bucket ready), the sync time (end
    minus arrival of that bucket's collective: long on a rank that waited for its peers),
    the CPU time of the thread that runs the timing (the training thread on CPU;
    autograd's device thread on CUDA) since the previous step's. Version 2 (what the agent
    sends, :data:`wire.COMM_VERSION`) carries them as integer microseconds, ``arrive_us``,
    ``sync_us``, ``cpu_us``, ``broadcast_us`` (about half the bytes of version 1's
    seconds; the end is arrival plus sync); version 1 as seconds, ``arrive_s``, ``end_s``,
    ``sync_s``, ``cpu_s``, ``broadcast_s``. Validated under the names sent; what ingest
    reads comes from :meth:`per_step`, in the units sent.
    Ingest stages the sync (plus the broadcast's wait: both are waits for peers), the CPU
    and the window's ``runq_s`` per step (``step_timings``) for the late-arrival detectors
    until the step's window is analysed.
    """

    version: Literal[1, 2]
    #: ``device``: CUDA events, every value of the section from the device; ``host``:
    #: the host clock (on CUDA, launch times). Wait and transfer are computed alike.
    clock: wire.CommClock = "host"
    arrive_s: list[StepSeconds | None] = Field(default_factory=list, max_length=MAX_STEPS)
    end_s: list[StepSeconds | None] = Field(default_factory=list, max_length=MAX_STEPS)
    sync_s: list[StepSeconds | None] = Field(default_factory=list, max_length=MAX_STEPS)
    cpu_s: list[StepSeconds | None] = Field(default_factory=list, max_length=MAX_STEPS)
    arrive_us: list[StepMicros | None] | None = Field(default=None, max_length=MAX_STEPS)
    sync_us: list[StepMicros | None] | None = Field(default=None, max_length=MAX_STEPS)
    cpu_us: list[StepMicros | None] | None = Field(default=None, max_length=MAX_STEPS)
    broadcast_us: list[StepMicros | None] | None = Field(default=None, max_length=MAX_STEPS)
    collectives: list[CollectiveIn] = Field(default_factory=list, max_length=16)
    groups: list[GroupSeqIn] = Field(default_factory=list, max_length=64)
    #: Per-connection link timing (staged in ``link_samples`` for the link detector).
    links: list[LinkIn] = Field(default_factory=list, max_length=wire.MAX_LINKS)
    #: A heartbeat's: seconds since the rank's last step ended when the counters were read.
    idle_s: Seconds | None = None
    #: Seconds the training thread waited on the run queue (runnable, no core free) during
    #: these steps (Linux schedstat; absent elsewhere): a rank late for want of a core is
    #: told from one that stalled. Staged per step in proportion to its time (``step_timings``).
    runq_s: Seconds | None = None
    #: Per step, seconds the training thread waited in DDP's buffer broadcast before its
    #: forward (host clock; absent without buffers to sync): a rank held there by a late
    #: peer (gloo relays the broadcast along a tree) starts late without being late itself.
    broadcast_s: list[StepSeconds | None] | None = Field(default=None, max_length=MAX_STEPS)

    @model_validator(mode="after")
    def _groups_once(self) -> CommIn:
        names = [g.group for g in self.groups]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"groups names process group {dup!r} more than once")
        return self

    @field_validator("version", mode="before")
    @classmethod
    def _integer_version(cls, v: Any) -> Any:
        if type(v) is not int:  # a Literal compares by equality: true would pass as 1
            raise ValueError(f"version must be the integer 1 or 2, not {type(v).__name__}")
        return v

    @model_validator(mode="after")
    def _one_version(self) -> CommIn:
        """The per-step lists of the version sent, each a list, and none of the other's;
        version 1's seconds under the resolution read as 0. (An ``after`` validator: a
        ``before`` one made pydantic build the whole section as Python objects first, a
        third of its validation.)"""
        v = self.version
        other = 1 if v == wire.COMM_VERSION else wire.COMM_VERSION
        sent = self.model_fields_set
        extra = [n for n in (*_COMM_STEP_LISTS[other], _COMM_BROADCAST[other]) if n in sent]
        if extra:
            raise ValueError(f"comm version {v} has no {extra[0]} (version {other} does)")
        missing = [n for n in _COMM_STEP_LISTS[v] if n not in sent or getattr(self, n) is None]
        if missing:
            raise ValueError(f"comm version {v} needs {missing[0]}: a list, one value per step")
        if v == 1:  # whole microseconds (version 2) are never under the resolution
            self.sync_s = _resolved_or_none(self.sync_s)
            self.cpu_s = _resolved_or_none(self.cpu_s)
            if self.broadcast_s is not None:
                self.broadcast_s = _resolved_or_none(self.broadcast_s)
        return self

    def per_step(
        self,
    ) -> tuple[float, Sequence[float | None], Sequence[float | None], Sequence[float | None] | None]:
        """What ingest reads of the section, per step, as sent, with their unit: the
        values per second (10**6 for :data:`wire.COMM_VERSION`'s integer microseconds, 1
        for version 1's seconds), then the sync, the CPU, and the broadcast's wait (None
        when not sent), ``None`` where a step had none. Left in the units sent, so that
        the fold converts a whole group's at once. The arrival (and version 1's end) are
        validated, not read."""
        if self.version == wire.COMM_VERSION:
            return 1e6, self.sync_us or [], self.cpu_us or [], self.broadcast_us
        return 1.0, self.sync_s, self.cpu_s, self.broadcast_s


class AckIn(_Strict):
    """An agent's acknowledgement of a directive (``wire``'s steering contract)."""

    id: DirectiveId
    state: wire.AckState
    reason: str | None = Field(default=None, max_length=200)
    #: The live settings in force after a config directive: reported, not requested, so
    #: any value the agent runs with (a send interval set at start below what a directive
    #: may ask for) is stored as it is.
    settings: dict[str, NonNeg] | None = Field(default=None, max_length=len(wire.LIVE_SETTINGS))

    @field_validator("settings")
    @classmethod
    def _live(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for name in v or {}:
            if name not in wire.LIVE_SETTINGS:
                raise ValueError(f"{name!r} is not a live setting (one of {sorted(wire.LIVE_SETTINGS)})")
        return v


class IngestPayload(_Strict):
    schema_version: Literal[1, 2]
    batch_id: str = Field(pattern=r"^[A-Za-z0-9_-]{8,64}$")
    run: RunName
    sent_at: UnixTime
    agent: AgentIn
    rank: RankIn
    convention: ConventionIn | None = None
    steps: StepsIn
    plan: PlanIn | None = None
    #: The rank's last batch (``close()``): it finished, so its silence is not a hang.
    final: bool = False
    #: No step: sent while the rank's training thread closed no window for a while, to
    #: say where it is (``comm.groups``); ``steps.wall_end`` is its last window's.
    heartbeat: bool = False
    profiles: list[ProfileIn] | None = Field(default=None, max_length=MAX_PROFILES)
    comm: CommIn | None = None
    acks: list[AckIn] | None = Field(default=None, max_length=wire.MAX_ACKS)

    @model_validator(mode="after")
    def _comm_per_step(self) -> IngestPayload:
        if self.comm is not None:
            n = len(self.steps.time_s)
            v = self.comm.version
            # The names sent (the version-2 lists are kept beside their seconds).
            for name in (*_COMM_STEP_LISTS[v], _COMM_BROADCAST[v]):
                got = getattr(self.comm, name)
                if got is not None and len(got) != n:
                    raise ValueError(f"comm.{name} has {len(got)} values but steps.time_s has {n}")
        return self

    @field_validator("schema_version", mode="before")
    @classmethod
    def _integer_version(cls, v: Any) -> Any:
        # A Literal compares by equality, so 2.0 and true would pass it even in strict mode.
        if type(v) is not int:
            raise ValueError(f"schema_version must be the integer 1 or 2, not {type(v).__name__}")
        return v

    @model_validator(mode="after")
    def _versioned(self) -> IngestPayload:
        if self.profiles is not None and self.schema_version < 2:
            raise ValueError("profiles need schema_version 2")
        return self

    @model_validator(mode="after")
    def _steps_or_final(self) -> IngestPayload:
        if self.heartbeat:
            if self.steps.time_s:
                raise ValueError("a heartbeat carries no step: steps.time_s must be empty")
            if self.final:
                raise ValueError("a heartbeat cannot be final")
            if self.comm is None or not self.comm.groups:
                raise ValueError("a heartbeat needs comm.groups (the collective counters it reports)")
        elif not self.steps.time_s and not self.final:
            raise ValueError("steps.time_s is empty; only a final batch or a heartbeat may carry no step")
        return self


#: Fields a payload no longer has, with what to send instead: a 422 names them so rather
#: than as "extra inputs" (at the edge, ``explained``: a model ``before`` validator made
#: pydantic build every payload as Python objects first, a tenth of its validation).
REMOVED_FIELDS = {
    # The v1 means-only breakdown had a second ingest path that the agent never used.
    "profile": "profile (the breakdown summary) was removed: send profiler windows as profiles",
}


def explained(errors: list[ErrorDetails]) -> list[ErrorDetails]:
    """``errors`` of an ingest body, a removed field named with what replaced it."""
    out = []
    for e in errors:
        loc = e["loc"]
        top = len(loc) == 1 or (len(loc) == 3 and loc[0] == "batches")  # a payload's own field
        if e["type"] == "extra_forbidden" and top and loc[-1] in REMOVED_FIELDS:
            e = {**e, "type": "value_error", "msg": str(REMOVED_FIELDS[str(loc[-1])])}
        out.append(e)
    return out


class IngestBatches(_Strict):
    """Several ranks' windows in one POST (per-host batching, ``wire.HOST_BATCH_PATH``):
    each entry is validated exactly as a payload posted alone, so a bad one is named as
    ``batches.<i>.<its field>`` with the message it would get alone."""

    batches: list[IngestPayload] = Field(min_length=1, max_length=wire.MAX_HOST_BATCHES)
