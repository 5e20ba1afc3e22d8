"""The wire contract: every name and pattern that the agent and the collector both spell.

The agent builds payloads with these (``_payload.py``), the
collector validates them with these (``stepwatch_server.schemas.ingest``), so a tag, a step
part or a pattern is defined once. Standard library only: a training job imports it,
and the collector imports it without the agent's dependencies.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal, get_args

#: The payload version the agent sends (the collector also accepts 1); 2 adds the
#: optional ``profiles`` list (profiler-window entries, ``stepwatch.profiler._entry``).
SCHEMA_VERSION = 2

#: Step tags: steps the collector excludes from baselines and regressions.
Tag = Literal["warmup", "checkpoint", "eval"]
#: Index = the code stored per step (0: untagged).
TAGS: tuple[str, ...] = ("", *get_args(Tag))
TAG_CODES: dict[str, int] = {name: code for code, name in enumerate(TAGS) if name}

#: The five parts a profiled step's time splits into (they sum to the step time).
StepPart = Literal["compute_s", "comm_overlapped_s", "comm_exposed_s", "data_wait_s", "idle_s"]
STEP_PARTS: tuple[str, ...] = get_args(StepPart)

#: Collective operation types, as the profiler names them.
CollectiveOp = Literal[
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "all_to_all",
    "broadcast",
    "send",
    "recv",
    "send_recv",
    "barrier",
    "reduce",
    "gather",
    "scatter",
    "other",
]
COLLECTIVE_OPS: tuple[str, ...] = get_args(CollectiveOp)

#: The ``comm`` section's version the agent sends: 2, per-step times as integer
#: microseconds (``arrive_us``, ``sync_us``, ``cpu_us``, ``broadcast_us``): about half the
#: bytes of version 1's seconds with six decimals (``arrive_s``, ``end_s``, ``sync_s``,
#: ``cpu_s``, ``broadcast_s``), which the collector still accepts. Issue 11's budget is
#: 2 KiB per rank-window for the whole section.
COMM_VERSION = 2

#: The clock of a ``comm`` section's per-step times (the agent's collective timing):
#: ``host``, ``perf_counter`` (on CUDA only launch times), or ``device``, CUDA events
#: recorded in the hook and its future's callback, read back on the sender thread.
CommClock = Literal["host", "device"]
#: The clock of a batch's step times (``agent.clock``, stored per rank as sent):
#: ``cuda_events`` when CUDA events at the step boundaries gave every step its time
#: (``host`` for a CUDA rank's window timed on the host: events incomplete at the
#: sender's deadline, or none free while the sender was far behind).
StepClock = Literal["host", "cuda_events"]

#: Parallelism dimensions of a rank's coordinates and communicator groups.
Dim = Literal["tp", "cp", "dp", "pp"]

#: A run name (also a baseline run's name).
RUN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
#: A training configuration's fingerprint (regressions compare runs that share one).
FINGERPRINT_PATTERN = r"^[A-Za-z0-9._:/+=-]{1,128}$"

#: Connections per window in the ``comm`` section's ``links`` (the busiest by bytes).
MAX_LINKS = 16
#: Endpoint ids in ``links`` are hashes of ``address:port`` below this bound (they fit
#: a signed 64-bit column).
ENDPOINT_ID_BOUND = 2**63

#: Per-host batching: one POST to ``HOST_BATCH_PATH`` carries ``{"batches": [...]}``, the
#: windows of several ranks of one host (each a whole payload with its own batch id, so
#: a retried POST stores each window once). It divides the collector's per-request cost
#: (HTTP, auth, the event loop's turn) by the ranks of the host; at most this many.
MAX_HOST_BATCHES = 256
INGEST_PATH = "/api/v1/ingest"
HOST_BATCH_PATH = "/api/v1/ingest/batches"


def host_batch(bodies: Sequence[bytes]) -> bytes:
    """The body of a ``HOST_BATCH_PATH`` POST carrying these encoded payloads, unparsed."""
    return b'{"batches":[' + b",".join(bodies) + b"]}"


# -- Steering: collector -> agents --------------------------------------------------------
#: The answer to an ingest POST may carry ``directives`` for the posting rank (no new
#: connection, no port on the training host); the rank's next batch acknowledges each in
#: ``acks``. A directive is applied at most once per process (idempotent by ``id``):
#:
#: Each directive carries ``"v"`` (:data:`DIRECTIVES_VERSION`); an agent refuses one of a
#: newer version than its own, with the reason, rather than guess at it.
#:
#: * ``{"id", "v", "kind": "capture", "first_step": S, "steps": K}``: profile steps
#:   ``S .. S+K-1`` with torch.profiler (every selected rank the same steps). Its result is
#:   the profiler entry carrying ``"capture": id`` (skipped, with the reason, if missed).
#:   With ``"trace_ranks": [r, ...]`` and ``"trace_max_bytes": N``, those ranks also upload
#:   the capture's raw trace, gzipped, when at most N bytes (``capture_trace_path``).
#: * ``{"id", "v", "kind": "config", "settings": {name: value}}``: change a live setting
#:   (:data:`LIVE_SETTINGS`) without a restart.
#:
#: An ack is ``{"id", "state": AckState, "reason"?, "settings"?}`` (``settings``: the
#: values in force after a config directive). Every payload's agent section also lists
#: ``"configs"``: the ids of the config directives this process applied or refused, newest
#: last, at most :data:`MAX_CONFIGS_REPORTED`; the collector sends a rank the live configs
#: that list lacks, so a restarted rank (a new process, an empty list) gets them again
#: although its predecessor acknowledged them.
DIRECTIVES_VERSION = 1
DirectiveKind = Literal["capture", "config"]
DIRECTIVE_KINDS: tuple[str, ...] = get_args(DirectiveKind)
#: ``scheduled``: a capture will run; ``missed``: it cannot (too late, profiler busy or
#: absent); ``applied`` / ``refused``: a config directive.
AckState = Literal["scheduled", "missed", "applied", "refused"]
ACK_STATES: tuple[str, ...] = get_args(AckState)
DIRECTIVE_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
#: Directives in one answer; acks in one payload.
MAX_DIRECTIVES = 8
MAX_ACKS = 16
MAX_CONFIGS_REPORTED = 16
#: Longest capture (steps): torch.profiler's buffers and the parse grow with it.
MAX_CAPTURE_STEPS = 16
#: What a config directive may change, each with its inclusive bounds.
LIVE_SETTINGS: dict[str, tuple[float, float]] = {
    "send_interval_s": (0.5, 3600.0),
    "profile_every": (0, 1_000_000),
    "profile_steps": (1, MAX_CAPTURE_STEPS),
}


def check_live_settings(settings: Any) -> tuple[dict[str, float], str | None]:
    """The live settings of a config directive, or the reason it is refused."""
    if not isinstance(settings, Mapping) or not settings:
        return {}, "settings must be a non-empty object"
    out: dict[str, float] = {}
    for name, value in settings.items():
        bounds = LIVE_SETTINGS.get(name)
        if bounds is None:
            return {}, f"{name!r} is not a live setting (one of {sorted(LIVE_SETTINGS)})"
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return {}, f"{name} must be a number"
        lo, hi = bounds
        if not lo <= value <= hi:
            return {}, f"{name}={value} is outside [{lo:g}, {hi:g}]"
        if name != "send_interval_s" and value != int(value):
            return {}, f"{name} must be an integer"
        out[name] = float(value) if name == "send_interval_s" else int(value)
    every, k = out.get("profile_every"), out.get("profile_steps")
    if every == 1 or (every and k is not None and k >= every):
        return {}, "profile_every must be 0 (off) or larger than profile_steps"
    return out, None


#: Where a rank uploads a capture's raw trace (``PUT``, a write token, gzipped Chrome JSON);
#: the same path serves it back (``GET``, a read token).
CAPTURE_TRACE_PATH = "/api/v1/runs/{run}/captures/{capture}/traces/{rank}"


def capture_trace_path(run: str, capture: str, rank: int) -> str:
    return CAPTURE_TRACE_PATH.format(run=run, capture=capture, rank=rank)
