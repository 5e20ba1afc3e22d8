"""Plain data the analysis consumes and produces.

Everything here is a frozen dataclass of numbers and strings so that the detectors can be
fed from any source (the ingest path, the simulator, a test) and property-tested without a
database. Validation of untrusted input happens at the edge (the collector's pydantic
schemas); these types only document the meaning and the units of each field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from stepwatch import wire

Kind = Literal["straggler", "regression", "hang"]
#: ``host_stall``: a rank arrived late with no extra CPU or loader wait (its host sat idle);
#: ``cpu_contention``: late for want of a core (its training thread runnable, waiting).
Cause = Literal["compute", "link", "data", "host", "host_stall", "cpu_contention"]
Status = Literal["open", "closed"]
StepTag = wire.Tag

#: Steps carrying one of these tags are never evidence of a regression: warm-up is not yet
#: the steady state, checkpoints and evaluation are planned pauses.
EXCLUDED_TAGS: frozenset[str] = frozenset(wire.TAG_CODES)


@dataclass(frozen=True, slots=True)
class RankWindow:
    """One rank's summary of one aggregation window.

    Windows are aligned across ranks: every rank closes window ``window`` at the same step,
    so the ranks of one window can be compared with each other. Times are means per step
    in seconds. The profiler fields are ``None`` when the profiler window did not cover
    this aggregation window.

    ``comm_wait_s`` is the time a rank waited for the last peer to arrive at its
    collectives (per step); ``comm_transfer_s`` the time from the last arrival to the end.
    ``groups`` maps a communicator type (``"dp"``, ``"tp"``, ``"pp"``, ``"cp"``) to the id
    of the group of that type this rank belongs to; ``group_transfer_s`` gives the
    transfer time this rank saw in each of them, keyed by the same type.
    """

    run: str
    rank: int
    host: str
    local_rank: int
    window: int
    first_step: int
    last_step: int
    n_steps: int
    step_time_s: float
    data_wait_s: float
    compute_s: float | None = None
    comm_exposed_s: float | None = None
    comm_overlapped_s: float | None = None
    idle_s: float | None = None
    comm_wait_s: float | None = None
    comm_transfer_s: float | None = None
    dp_rank: int | None = None
    tp_rank: int | None = None
    pp_rank: int | None = None
    cp_rank: int | None = None
    groups: Mapping[str, str] = field(default_factory=dict, hash=False)
    group_transfer_s: Mapping[str, float] = field(default_factory=dict, hash=False)

    @property
    def peer_key(self) -> tuple[int | None, int | None, int | None]:
        """Ranks with the same key do the same work and may be compared.

        Pipeline stages differ by design (different layers, the loss on the last stage),
        and so may tensor- and context-parallel shards; only the data-parallel replicas of
        one (stage, tensor rank, context rank) cell are peers. Without a layout every key
        is ``(None, None, None)``: pure data parallel, all ranks are peers.
        """
        return (self.pp_rank, self.tp_rank, self.cp_rank)


@dataclass(frozen=True, slots=True)
class JobStep:
    """One sample of the job-level series: a step, or a window of ``n_steps`` steps.

    ``step`` is the last step the sample covers; a window sample covers steps
    ``step - n_steps + 1 .. step``. ``mfu`` is a 0-1 ratio or ``None`` when the hardware
    peak is unknown. The breakdown means are per step and optional; ``cpu_s`` is the
    training thread's CPU time per step where the always-on timing measured it.

    A window sample built from its per-step job rows also carries their robust summary:
    ``step_time_median_s`` and ``mfu_median`` (medians over its untagged steps),
    ``step_time_spread_s`` (1.4826 x their MAD) and ``n_samples`` (how many there were),
    which the regression detector uses instead of the mean, so a few long steps do not
    move a window, and to know how noisy one window's median is.
    """

    step: int
    step_time_s: float
    tokens: float
    mfu: float | None = None
    tag: StepTag | None = None
    n_steps: int = 1
    compute_s: float | None = None
    comm_exposed_s: float | None = None
    comm_overlapped_s: float | None = None
    data_wait_s: float | None = None
    idle_s: float | None = None
    cpu_s: float | None = None
    step_time_median_s: float | None = None
    step_time_spread_s: float | None = None
    mfu_median: float | None = None
    n_samples: int = 0

    @property
    def first_step(self) -> int:
        """The first step this sample covers."""
        return self.step - max(self.n_steps, 1) + 1


@dataclass(frozen=True, slots=True)
class Finding:
    """A straggler, regression or hang flag, as a person and an alert rule see it.

    ``key`` names the thing flagged (``straggler:compute:rank=2``, ``regression:mfu``,
    ``hang:run``) and is stable across windows; ``(key, first_step)`` identifies one
    occurrence, so the collector can upsert a flag as it goes from open to closed.
    ``cost_seconds`` is what the flag costs per step (a straggler: how much shorter the
    step would be if the rank ran at its peers' median; a regression: the step-time
    increase; a hang: the seconds without a step) and ``cost_ratio`` the same as a share
    of step time (of the silent time for a hang, hence 1.0).
    """

    kind: Kind
    run: str
    key: str
    cause: Cause | None
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]
    first_step: int
    last_step: int
    status: Status
    evidence: Mapping[str, float]
    cost_seconds: float
    cost_ratio: float
    message: str
    metric: str | None = None
    #: A hang's stuck collective (``StuckCollective.to_dict``): structured, not a number,
    #: so kept apart from ``evidence``; the event stores it as ``evidence.collective``.
    collective: Mapping[str, Any] | None = None
    #: The detector that raised it (``window``: the per-window detector of :mod:`.peers`;
    #: ``arrivals``: the always-on late-arrival detector), so that the collector can keep
    #: one event when both flag the same key.
    source: str = ""

    @property
    def id(self) -> str:
        """One occurrence of a flag: its key and the step it started at."""
        return f"{self.key}@{self.first_step}"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (tuples become lists)."""
        return {
            "kind": self.kind,
            "run": self.run,
            "key": self.key,
            "cause": self.cause,
            "ranks": list(self.ranks),
            "hosts": list(self.hosts),
            "first_step": self.first_step,
            "last_step": self.last_step,
            "status": self.status,
            "evidence": dict(self.evidence),
            "cost_seconds": self.cost_seconds,
            "cost_ratio": self.cost_ratio,
            "message": self.message,
            "metric": self.metric,
            "collective": dict(self.collective) if self.collective is not None else None,
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Finding:
        """Inverse of :meth:`to_dict`."""
        return cls(
            kind=cast(Kind, data["kind"]),
            run=str(data["run"]),
            key=str(data["key"]),
            cause=cast("Cause | None", data.get("cause")),
            ranks=tuple(int(r) for r in data.get("ranks", ())),
            hosts=tuple(str(h) for h in data.get("hosts", ())),
            first_step=int(data["first_step"]),
            last_step=int(data["last_step"]),
            status=cast(Status, data["status"]),
            evidence={str(k): float(v) for k, v in dict(data.get("evidence", {})).items()},
            cost_seconds=float(data["cost_seconds"]),
            cost_ratio=float(data["cost_ratio"]),
            message=str(data["message"]),
            metric=None if data.get("metric") is None else str(data["metric"]),
            collective=None if data.get("collective") is None else dict(data["collective"]),
            source=str(data.get("source", "")),
        )
