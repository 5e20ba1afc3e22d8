"""The wire contract: every name and pattern that the agent and the collector both spell.

The agent builds payloads with these (``_payload.py``), the
collector validates them with these (``stepwatch_server.schemas.ingest``), so a tag, a step
part or a pattern is defined once. Standard library only: a training job imports it,
and the collector imports it without the agent's dependencies.
"""

from __future__ import annotations

from typing import Literal, get_args

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
