"""A closed window of steps: the unit the hot path hands to the sender.

The hot path copies its preallocated arrays into one of these (a few memcpy-sized
slices every window, never per step) and appends it to the sender's queue. Turning it
into a payload (device-time resolution, JSON) happens on the sender's thread.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._comm_timing import TimingSlices
    from ._device_clock import Boundaries, DeviceEvent
    from .wire import StepClock


@dataclass
class Window:
    """Per-step columns of one window, plus what is needed to finish them off-thread."""

    first_step: int
    step_time_s: array[float]
    data_wait_s: array[float]
    tokens: array[int]
    padded_tokens: array[int] | None
    tags: array[int] | None
    wall_end: float
    #: On CUDA: (the previous window's last boundary event, this window's boundaries).
    device_events: tuple[DeviceEvent | None, Boundaries] | None = None
    #: The clock of ``step_time_s`` once resolved (first encoding; a retry keeps it).
    step_clock: StepClock | None = None
    batch_id: str = field(default="")
    #: The rank's last window (``close()``): the collector then knows the rank finished
    #: rather than hung. A final window may hold no steps.
    final: bool = False
    #: Profiler-window entries riding on this batch; fixed at its first encoding so that
    #: a retry sends the same body.
    profiles: list[dict[str, Any]] | None = None
    #: The rank owes no profiler entry of a window that starts at or before this step: it
    #: rode on this batch or an earlier one, or was lost (``steps.profiles_through``;
    #: ``ProfilerWindow.take_through``), fixed like profiles.
    profiles_through: int | None = None
    #: Acknowledgements of the collector's directives (``_steering``), fixed like profiles.
    acks: list[dict[str, Any]] | None = None
    #: The communication hook's slots for these steps (summarised on the sender thread
    #: into ``comm_section``, once, so that a retry sends the same body).
    comm: TimingSlices | None = None
    comm_section: dict[str, Any] | None = None
    #: Host clock (``perf_counter``) at the end of the last step: places the hook's times.
    perf_end: float = 0.0
    #: Seconds the training thread waited on the run queue (runnable, no core free)
    #: during these steps (``_sched``); None where not measured.
    runq_s: float | None = None
    #: A heartbeat (no step): built by the sender thread while the training thread has
    #: closed no window for a while, to carry the collective counters of a rank that may
    #: be stuck in (or before) a collective. ``wall_end`` is then the last window's.
    heartbeat: bool = False

    @property
    def n_steps(self) -> int:
        return len(self.step_time_s)

    def approx_bytes(self) -> int:
        """Memory held by this window, for the agent's memory bound."""
        n = self.n_steps
        comm = self.comm.approx_bytes() if self.comm is not None else 0
        return 200 + comm + n * (8 + 8 + 8 + (8 if self.padded_tokens is not None else 0) + 1)
