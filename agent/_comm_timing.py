"""Always-on timing of the step's collectives, without torch.profiler.

Why: a straggler is the rank whose inputs reach the collective last, and the profiler
window sees that on 2 steps in 100. A DDP communication hook sees it on every step, for
the price of a clock read per bucket: the hook is called when a bucket's gradients are
ready (the rank's *arrival* at that collective) and the future it returns completes when
the all-reduce has ended. Per step this module keeps, per bucket, those two host times
in preallocated slots; the window's hand-off copies the filled slices and the sender
thread summarises them (:func:`summarise`): a few numbers per step and one duration
sketch per collective type, never one record per collective.

The numbers need no clock shared between ranks. A collective ends at about the same
moment on every rank of its group, so ``end - arrival`` of the last bucket (the rank's
*sync* time) is long on ranks that waited and short on the one that arrived last; the
collector compares it across ranks step by step.

Wrapping changes nothing DDP computes: the default inner is DDP's own reduction (scale
by 1/size into the bucket, then all-reduce: the same multiplication the built-in reducer
applies, so gradients are bit-identical, tested on real gloo ranks), a user's hook
(``comm_hook(inner=...)``) runs unchanged, and the bucket order and overlap are DDP's.

CPU: host clock (``perf_counter``) and the training thread's CPU clock, which tells
a rank that computed longer (more CPU) from one that stalled (no CPU). CUDA (decided
once, at the hook's first bucket: its tensor is on a CUDA device): the host times are
only launch times, so the hook also records a CUDA event per bucket at its arrival and
one in the future's ``then()`` callback at its end (``_comm_device``); the sender reads
them back with ``query()``/``elapsed_time()`` against the agent's step boundary events
and ships the window with ``"clock": "device"``, or, when an event has not completed by
then (the step clock's deadline), with the host times and ``"clock": "host"``. Nothing
synchronises the GPU. On CUDA ``cpu_us`` is the CPU time of the thread that runs the hook
(autograd's device thread), not the training thread's.

Per process group the hook also counts the collectives entered and completed
(:class:`GroupSeq`), with the op and entry time of the last :data:`SEQ_RING` of them in
a preallocated ring. When a run stops, those counters name the collective it stopped
in: the ranks that never entered it and the ranks waiting in it since when (the
collector's hang diagnosis). The sender thread reads them for every batch and, while
the training thread is stuck and closes no window, for its heartbeats.

Longer than the usual module: the hook, the preallocated per-step slots it fills, the
per-group counters and the window summary the sender builds from those slots share one
layout of arrays; split, each part would restate it.
"""

from __future__ import annotations

import contextlib
import math
import time
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._comm_device import CommEvents, DeviceEnd, DeviceSlots
from ._comm_device import resolve as resolve_device
from ._device_clock import DeviceEvent
from .sketch import LogSketch
from .wire import COLLECTIVE_OPS, COMM_VERSION, CommClock

#: Buckets timed one by one per step; later ones share the last slot, which then holds
#: the latest arrival (the last bucket's, so the step's sync time stays right).
MAX_BUCKETS = 16
#: Relative accuracy of the duration sketches (1%, as the profiler window's).
SKETCH_ALPHA = 0.01
_perf = time.perf_counter
_cpu = time.thread_time
_wall = time.time
_NONE = -1.0
#: Process groups counted (the wire's limit); a further group is timed but not counted.
MAX_GROUPS = 64
#: Collectives per group whose op and entry time are kept: the oldest one still in
#: flight is found among them while fewer than this many are in flight at once.
SEQ_RING = 256
#: Op codes: indexes into ``wire.COLLECTIVE_OPS``.
OP_CODES = {op: i for i, op in enumerate(COLLECTIVE_OPS)}
ALL_REDUCE = OP_CODES["all_reduce"]
BROADCAST = OP_CODES["broadcast"]


class GroupSeq:
    """One process group's collective counters, allocated once at its first collective.

    Written by the hook (``entered``, the ring) and by completions (``completed``), read
    by the sender thread; each write is one store, and the ring slot of collective ``n``
    is written before ``entered`` becomes ``n``, so a reader never sees an unwritten slot.
    ``completed`` is the highest sequence number completed (collectives of one group
    complete in order on every backend this hook serves)."""

    __slots__ = ("completed", "entered", "ops", "times")

    def __init__(self) -> None:
        self.entered = 0
        self.completed = 0
        self.ops = array("b", bytes(SEQ_RING))
        self.times = array("d", bytes(8 * SEQ_RING))

    def state(self, group: str, wall_offset: float) -> dict[str, Any]:
        """The wire entry: counters, and the op and entry time (Unix seconds: host clock
        plus ``wall_offset``) of the collective the rank is in, the oldest one entered
        and not completed, or of the last one entered when none is in flight."""
        entered, completed = self.entered, self.completed
        out: dict[str, Any] = {"group": group, "entered": entered, "completed": min(completed, entered)}
        n = completed + 1 if entered > completed else entered
        if n > 0 and entered - n < SEQ_RING:
            k = n % SEQ_RING
            out["op"] = COLLECTIVE_OPS[self.ops[k]]
            out["since"] = round(self.times[k] + wall_offset, 3)
        return out


@dataclass
class TimingSlices:
    """What one window's steps recorded (copies, owned by the window)."""

    step_of: array[int]
    n_buckets: array[int]
    bytes: array[int]
    cpu: array[float]
    #: Bucket-major, ``n`` slots per bucket (bucket ``b`` of step ``i`` at ``b * n + i``):
    #: host ``perf_counter`` seconds; ``end`` is -1 where the collective did not complete.
    arrive: array[float]
    end: array[float]
    #: On CUDA: the device events of these slots (read on the sender thread).
    device: DeviceSlots | None = None
    #: Per step slot: the step whose :meth:`CommTiming.held` seconds ``held`` holds
    #: (-1: none), and the seconds the training thread waited in DDP's buffer broadcast.
    held_step: array[int] = field(default_factory=lambda: array("q"))
    held: array[float] = field(default_factory=lambda: array("d"))
    #: Slots per bucket (``comm_hook``), or one per step for the whole reduction
    #: (``_ddp_timing``: no per-collective durations to summarise).
    per_bucket: bool = True

    def approx_bytes(self) -> int:
        return 64 + 8 * (6 * len(self.step_of) + 2 * len(self.arrive))


class CommTiming:
    """Preallocated per-step slots filled by the communication hook.

    ``position`` is a callable returning (window's first step, slot index) of the step in
    progress: the agent's counters, read without a lock (the hook runs on the training
    thread, in backward, before that step's ``sw.step()``).
    """

    def __init__(self, capacity: int, position: Callable[[], tuple[int, int]]) -> None:
        self._cap = capacity
        self._position = position
        self._step_of = array("q", [-1]) * capacity
        self._n_buckets = array("q", bytes(8 * capacity))
        self._bytes = array("q", bytes(8 * capacity))
        self._cpu = array("d", bytes(8 * capacity))
        self._arrive = array("d", bytes(8 * capacity * MAX_BUCKETS))
        self._end = array("d", [_NONE]) * (capacity * MAX_BUCKETS)
        #: Seconds each step waited in DDP's buffer broadcast (:meth:`held`), and the step
        #: each slot's sum belongs to.
        self._held_step = array("q", [-1]) * capacity
        self._held = array("d", bytes(8 * capacity))
        #: Per process group: collectives entered and completed (see :class:`GroupSeq`);
        #: the sequence numbers a hang diagnosis needs (which rank never entered which one).
        self.seq: dict[str, GroupSeq] = {}
        #: The groups this rank is a member of (``_collectives``: from torch's registry),
        #: listed at 0 entered before their first collective: a member that never
        #: entered one is then named by the hang diagnosis, not absent from the group.
        self.known_groups: Callable[[], Iterable[str]] | None = None
        self.used = False
        #: False when ``_ddp_timing`` fills one slot per step (the whole reduction).
        self.per_bucket = True
        self._cpu_prev: float | None = None  # sender thread: CPU clock at the previous step
        #: On CUDA (:meth:`start_device`): the slots' arrival and end events.
        self._events: CommEvents | None = None

    def start_device(self, make_event: Callable[[], DeviceEvent]) -> None:
        """Time the slots on the device too (the hook's first bucket is on CUDA): the
        slots' generations (their events are made at each slot's first use in each,
        see ``_comm_device``)."""
        if self._events is None:
            self._events = CommEvents(self._cap * MAX_BUCKETS, self._cap, make_event)

    @property
    def on_device(self) -> bool:
        return self._events is not None

    def device_arrival(self, slot: int) -> DeviceEnd | None:
        """Hook side, after :meth:`arrive`: record the bucket's device arrival on the
        current stream; returns the event its ``then()`` callback records at the end
        (None on the host clock, past the window's capacity, or with no generation free)."""
        ev = self._events
        if ev is None or slot < 0:
            return None
        return ev.record_arrival(slot)

    # -- hook side (training thread; completions on the backend's threads) ----------
    def arrive(
        self, group: str, bucket_index: int, nbytes: int, op: int = ALL_REDUCE
    ) -> tuple[int, int] | None:
        """A bucket is ready: record its arrival. Returns (its sequence number in
        ``group``, the slot its end goes to; -1 past the window's capacity), or None when
        nothing was recorded. ``op`` is an :data:`OP_CODES` value."""
        now = _perf()
        # Counted even past the window's capacity: a hang needs them.
        n = self._count(group, op, now)
        first, i = self._position()
        if i >= self._cap:
            return (n, -1) if n else None
        step = first + i
        if self._step_of[i] != step:  # first collective of this step
            self._step_of[i] = step
            self._n_buckets[i] = 0
            self._bytes[i] = 0
            for k in range(i, self._cap * MAX_BUCKETS, self._cap):
                self._end[k] = _NONE
        b = min(bucket_index, MAX_BUCKETS - 1)
        k = b * self._cap + i
        self._arrive[k] = now
        self._cpu[i] = _cpu()
        self._n_buckets[i] = max(self._n_buckets[i], b + 1)
        self._bytes[i] += nbytes
        self.used = True
        return n, k

    def held(self, seconds: float) -> None:
        """The training thread waited ``seconds`` in DDP's buffer broadcast before the
        forward of the step in progress (summed over a step's forwards).

        Why: a collective is a dependency between ranks, not only a meeting point. gloo
        broadcasts along a tree (with 4 ranks, rank 1 gets rank 0's buffers through rank
        3), so a rank that enters the broadcast late, say after a slow loader, holds up the
        ranks below it, which then start their forward late and reach the gradient
        all-reduce late with no more work than their peers: measured, 0.1 s behind on every
        step, named a host stall. Shipped per step (``comm.broadcast_s``), the wait lets the
        collector count it as waiting for peers, like the all-reduce's, and look for the
        rank that was late."""
        first, i = self._position()
        if i >= self._cap:
            return
        step = first + i
        if self._held_step[i] != step:
            self._held_step[i] = step
            self._held[i] = 0.0
        self._held[i] += seconds
        self.used = True

    def enter(self, group: str, op: int) -> tuple[int, int] | None:
        """A collective the hook does not see began (DDP's buffer broadcast before each
        forward): counted in ``group``'s sequence, not timed. Returns the token for
        :meth:`done`, or None past :data:`MAX_GROUPS` groups."""
        n = self._count(group, op, _perf())
        return (n, -1) if n else None

    def _count(self, group: str, op: int, now: float) -> int:
        """Enter the next collective of ``group``: its sequence number (0: not counted)."""
        g = self.seq.get(group)
        if g is None:
            if len(self.seq) >= MAX_GROUPS:
                return 0
            # setdefault: the sender thread may add the same group (``known_groups``).
            g = self.seq.setdefault(group, GroupSeq())
        n = g.entered + 1
        k = n % SEQ_RING
        g.ops[k] = op
        g.times[k] = now
        g.entered = n
        return n

    def done(self, token: tuple[int, int] | None, group: str, at: float | None = None) -> None:
        """The collective of ``token`` completed (any thread: one slot, one store), now or,
        where the caller knows better, at host time ``at`` (never before its arrival)."""
        if token is None:
            return
        k = token[1]
        if k >= 0:
            self._end[k] = _perf() if at is None else max(at, self._arrive[k])
        g = self.seq.get(group)
        if g is not None and token[0] > g.completed:
            g.completed = token[0]

    def ended(
        self, token: tuple[int, int] | None, group: str, end_event: DeviceEnd | None, at: float | None = None
    ) -> None:
        """:meth:`done`, after recording the device end event :meth:`device_arrival`
        returned, on the stream current where the end is seen (after the collective's
        kernels). A failed record (a CUDA error the training meets too) does not raise, and
        unmarks the slot (its event holds an earlier window's record)."""
        if end_event is not None:
            ev, marks, k = end_event
            try:
                ev.record()
            except Exception:
                marks[k] = 0
        self.done(token, group, at)

    def groups(self) -> list[dict[str, Any]]:
        """Every counted group's wire entry, now (sender thread)."""
        known = self.known_groups
        if known is not None:
            try:
                for name in known():
                    if name not in self.seq and len(self.seq) < MAX_GROUPS:
                        self.seq.setdefault(name, GroupSeq())
            except Exception:
                pass  # torch's registry changed under us: the next read lists them
        offset = _wall() - _perf()
        return [g.state(name, offset) for name, g in sorted(self.seq.items())]

    # -- window hand-off (training thread, once per window) ---------------------------
    def take(self, n: int) -> TimingSlices | None:
        if not self.used:
            return None
        nb = max(self._n_buckets[:n], default=0)
        cap = self._cap
        arrive = array("d")
        end = array("d")
        for b in range(nb):  # one memcpy per bucket: only the buckets this window used
            arrive += self._arrive[b * cap : b * cap + n]
            end += self._end[b * cap : b * cap + n]
        return TimingSlices(
            self._step_of[:n],
            self._n_buckets[:n],
            self._bytes[:n],
            self._cpu[:n],
            arrive,
            end,
            self._events.take() if self._events is not None else None,
            held_step=self._held_step[:n],
            held=self._held[:n],
            per_bucket=self.per_bucket,
        )

    # -- sender thread ------------------------------------------------------------------
    def summarise(
        self,
        s: TimingSlices,
        first_step: int,
        step_times: Sequence[float],
        perf_end: float,
        *,
        device_steps: DeviceSteps | None = None,
    ) -> dict[str, Any]:
        """The window's ``comm`` payload section (see :func:`summarise`); ``perf_end`` is
        the host clock at the end of the window's last step, ``step_times`` the host's
        step times. On CUDA, ``device_steps`` gives the agent's step boundaries on the
        device; the section is on the device clock when every event it needs completed."""
        dev = self._device_slices(s, first_step, device_steps)
        if dev is not None:
            slices, times = dev
            # Device offsets are already relative to each step's start: start = end - time = 0.
            out, self._cpu_prev = summarise(slices, first_step, times, times, self._cpu_prev, clock="device")
        else:
            ends = [0.0] * len(step_times)
            t = perf_end
            for i in range(len(step_times) - 1, -1, -1):
                ends[i] = t
                t -= step_times[i]
            out, self._cpu_prev = summarise(s, first_step, ends, step_times, self._cpu_prev)
        out["groups"] = self.groups()
        return out

    @staticmethod
    def _device_slices(
        s: TimingSlices, first_step: int, device_steps: DeviceSteps | None
    ) -> tuple[TimingSlices, Sequence[float]] | None:
        """The slices with device offsets in place of host times, and the device step
        times; None (host clock) without device events or when one is not complete."""
        if s.device is None:
            return None
        if device_steps is None:  # no step clock on the device, or a step kept host time
            s.device.release()
            return None
        prev, boundaries, times = device_steps
        starts: list[DeviceEvent | None] = [prev, *boundaries[:-1]]
        got = resolve_device(s.device, s.step_of, s.n_buckets, s.end, first_step, starts, boundaries, _NONE)
        if got is None or len(times) != len(s.step_of):
            return None
        arrive, end = got
        # Without ``held``: the broadcast's host time is only its launch on CUDA.
        sliced = TimingSlices(s.step_of, s.n_buckets, s.bytes, s.cpu, arrive, end, per_bucket=s.per_bucket)
        return sliced, times

    def heartbeat_section(self, idle_s: float) -> dict[str, Any]:
        """The ``comm`` section of a heartbeat: no step, the group counters as they are
        now (the training thread may be stuck inside, or before, a collective), and
        ``idle_s``: seconds since the rank's last step ended."""
        return {
            "idle_s": round(min(max(0.0, idle_s), 1e6), 3),
            "version": COMM_VERSION,
            "clock": "host",
            "arrive_us": [],
            "sync_us": [],
            "cpu_us": [],
            "collectives": [],
            "groups": self.groups(),
        }


#: What the sender knows of a window's steps on the device: (the boundary before its
#: first step, one boundary event per step, the device step times in seconds).
DeviceSteps = tuple[DeviceEvent | None, Sequence[DeviceEvent], Sequence[float]]


def _us(x: float) -> int | None:
    """Seconds as the wire's integer microseconds (``wire.COMM_VERSION``), at least 0;
    None for a value that is not a time (not finite)."""
    return max(0, round(x * 1e6)) if math.isfinite(x) else None


def summarise(
    s: TimingSlices,
    first_step: int,
    step_ends: Sequence[float],
    step_times: Sequence[float],
    cpu_prev: float | None,
    *,
    clock: CommClock = "host",
) -> tuple[dict[str, Any], float | None]:
    """Per-step numbers (integer microseconds, relative to the step's start on this
    rank's ``clock``; ``None`` for a step without a collective) and per-window totals.

    ``arrive_us``: last bucket ready (backward done); ``sync_us`` = end of the last
    bucket's collective - its arrival (short on the rank the others waited for; the end
    is arrival plus sync); ``cpu_us``: training-thread CPU time since the previous step's
    last arrival (``None`` for the first step seen); ``broadcast_us`` (only where some
    step waited in DDP's buffer broadcast, on the host clock): that wait, per step.
    Returns (section, CPU clock of the last step).
    """
    n = len(step_ends)
    arrive_us: list[int | None] = [None] * n
    sync_us: list[int | None] = [None] * n
    cpu_us: list[int | None] = [None] * n
    sketch = LogSketch(SKETCH_ALPHA)
    count = nbytes = 0
    for i in range(n):
        nb = s.n_buckets[i]
        if s.step_of[i] != first_step + i or nb == 0:
            continue
        start = step_ends[i] - step_times[i]
        last_b, last_a = -1, -math.inf
        for b in range(i, nb * n, n):
            e = s.end[b]
            if e == _NONE:
                continue
            a = s.arrive[b]
            if s.per_bucket:
                sketch.add(max(0.0, e - a))
            count += 1
            if a > last_a:
                last_b, last_a = b, a
        if last_b < 0:
            continue
        nbytes += s.bytes[i]
        arrive_us[i] = _us(last_a - start)
        sync_us[i] = _us(s.end[last_b] - last_a)
        if cpu_prev is not None:
            cpu_us[i] = _us(s.cpu[i] - cpu_prev)
        cpu_prev = s.cpu[i]
    section: dict[str, Any] = {
        "version": COMM_VERSION,
        "clock": clock,
        "arrive_us": arrive_us,
        "sync_us": sync_us,
        "cpu_us": cpu_us,
        # Per-collective durations only where each bucket was timed on its own.
        "collectives": [{"op": "all_reduce", "count": count, "bytes": nbytes, "duration": sketch.to_dict()}]
        if count and s.per_bucket
        else [],
    }
    if clock == "host" and len(s.held_step) >= n:
        held: list[int | None] = [
            _us(s.held[i]) if s.held_step[i] == first_step + i else None for i in range(n)
        ]
        if any(v is not None for v in held):
            section["broadcast_us"] = held
    return section, cpu_prev


Hook = Callable[[Any, Any], Any]


def comm_hook(inner: Hook | None = None, *, timing: CommTiming | None = None) -> Hook:
    """A DDP communication hook that times each bucket and then runs ``inner``.

    ``inner`` is any DDP hook (``state, bucket -> Future[Tensor]``), e.g.
    ``bf16_compress_hook``; register the result with ``ddp.register_comm_hook(state,
    stepwatch.comm_hook(inner=bf16_compress_hook))``. Without ``inner``, DDP's own
    averaging all-reduce runs (bit-identical gradients); ``sw.watch(ddp)`` registers that.
    The timing goes to ``timing``, or to the agent of the last ``stepwatch.init``.
    Nothing here raises into backward: a timing failure only loses the timing.

    The clock is chosen once, at the first bucket the hook times: on CUDA (the bucket's
    tensor is on a CUDA device) each bucket also records a device event at its arrival
    and one in the ``then()`` callback at its end (see the module docstring); the
    per-call cost is then two ``Event.record()`` calls, never a synchronisation.
    """
    import torch.distributed as dist

    from ._collectives import Quiet

    bound: list[CommTiming | None] = [timing]
    #: Whether this hook records device events: decided once, at its first timed bucket.
    device: list[bool | None] = [None]

    def _timing() -> CommTiming | None:
        if bound[0] is None:
            from ._api import current

            agent = current()
            bound[0] = agent.comm_timing if agent is not None else None
        return bound[0]

    #: The last ``state``'s resolution (DDP passes the same one to every call): (state,
    #: the group's wire label, and without ``inner``: the process group, 1/size and the
    #: all-reduce's options).
    resolved: list[tuple[Any, str, Any, float, Any] | None] = [None]

    def _resolve(state: Any) -> tuple[Any, str, Any, float, Any]:
        r = resolved[0]
        if r is not None and r[0] is state:
            return r
        try:
            label = group_label(state if isinstance(state, dist.ProcessGroup) else None)
        except Exception:
            label = "world"
        pg, scale, opts = None, 1.0, None
        if inner is None:  # DDP's own reduction: what ``dist.all_reduce(async_op=True)`` passes
            pg = state if state is not None else dist.group.WORLD
            scale = 1.0 / dist.get_world_size(pg)
            opts = dist.AllreduceOptions()  # its reduceOp is SUM, as dist.all_reduce's default
            if hasattr(opts, "asyncOp"):
                opts.asyncOp = True
        r = (state, label, pg, scale, opts)
        resolved[0] = r
        return r

    def hook(state: Any, bucket: Any) -> Any:
        buf = bucket.buffer()
        t = _timing()
        _, group, pg, scale, opts = _resolve(state)
        token = None
        end_event = None
        if t is not None:
            try:
                if device[0] is None:
                    device[0] = False  # decided once: a failure here leaves the host clock
                    device[0] = _start_device(t, buf)
                token = t.arrive(group, bucket.index(), buf.numel() * buf.element_size())
            except Exception:
                token = None
            if device[0] and token is not None:
                try:  # apart: the collective is entered now and must be marked completed
                    end_event = t.device_arrival(token[1])
                except Exception:
                    end_event = None
        if inner is None:
            # The built-in reducer's scaling: a multiplication by 1/size (not a division).
            buf.mul_(scale)
            if buf.is_complex():  # ``dist.all_reduce`` reduces complex tensors as real views
                with Quiet():
                    fut = dist.all_reduce(buf, group=pg, async_op=True).get_future()
            else:
                # The process group's own all-reduce, which ``dist.all_reduce`` calls after
                # its checks (one dense tensor, rank in the group, no coalescing: all true
                # of a DDP bucket): the same collective with the same options, without
                # that Python. Measured on the loaded 2-core machine (``benchmarks.
                # comm_timing``'s isolated phase), the hook's CPU over the built-in
                # reduction fell from 23 to 15 us per bucket, torch's ``allreduce_hook``'s
                # own cost. Not through the collective-counting wrappers: the bucket is
                # counted here.
                fut = pg.allreduce([buf], opts).get_future()
        else:
            # The bucket is counted here: the collective-counting wrappers (``_collectives``,
            # when installed) must not count the user hook's all-reduce again.
            with Quiet():
                fut = inner(state, bucket)
        if token is None:
            return fut if inner is not None else fut.then(_first)

        def finished(f: Any) -> Any:
            t.ended(token, group, end_event)  # type: ignore[union-attr]
            return f.value() if inner is not None else f.value()[0]

        return fut.then(finished)

    # DDP checks the annotations against its own classes; under postponed evaluation
    # they are strings, so the hook shows it none (torch is imported lazily here).
    hook.__annotations__ = {}
    return hook


def _first(f: Any) -> Any:
    return f.value()[0]


def _start_device(timing: CommTiming, buf: Any) -> bool:
    """The hook's clock, decided at its first bucket: device events when the bucket is on
    CUDA and CUDA events can be made, else the host clock only."""
    if not getattr(buf, "is_cuda", False):
        return False
    from ._comm_device import cuda_event_factory

    make = cuda_event_factory()
    if make is None:
        return False
    timing.start_device(make)
    return True


def group_label(pg: Any) -> str:
    """A process group's name on the wire: ``"world"`` for the default group (every rank
    is a member: the collector's hang diagnosis counts a silent rank in it), else its
    ``group_name``."""
    import torch.distributed as dist

    if pg is None or pg is dist.group.WORLD:
        return "world"
    return str(getattr(pg, "group_name", "") or "world")


def count_buffer_broadcast(ddp: Any, timing: CommTiming) -> bool:
    """Count DDP's broadcast of module buffers (rank 0's to every rank, before each
    forward) in the group's collective sequence, beside the gradient buckets.

    The comm hook does not see it, yet a rank blocks in it: with a peer hung before its
    forward, some ranks wait in the broadcast while others (which got rank 0's buffers)
    go on to the next all-reduce; without this count they look as if they never entered
    that all-reduce, like the hung rank. Its duration goes to :meth:`CommTiming.held`
    (the wait there for a late peer, which the collector counts as waiting, not as
    lateness of this rank). Two forward pre-hooks bracket it: the outer
    one on the DDP module runs before ``DDP.forward`` (which broadcasts first), the inner
    one on the wrapped module after it. Returns whether the hooks were installed (a
    model without buffers to sync, or not a DDP module, needs none).
    """
    will_sync = getattr(ddp, "will_sync_module_buffers", None)
    inner = getattr(ddp, "module", None)
    if will_sync is None or inner is None or not will_sync():
        return False
    group = group_label(getattr(ddp, "process_group", None))
    pending: list[tuple[int, int] | None] = [None]
    began = [_NONE]

    def before(_module: Any, _inputs: Any) -> None:
        try:
            syncs = will_sync()
            began[0] = _perf() if syncs else _NONE
            pending[0] = timing.enter(group, BROADCAST) if syncs else None
        except Exception:
            pending[0] = None

    def after(_module: Any, _inputs: Any) -> None:
        token, pending[0] = pending[0], None
        t0, began[0] = began[0], _NONE
        if token is not None:  # the inner module called through DDP, broadcast done
            timing.done(token, group)
        if t0 != _NONE:
            with contextlib.suppress(Exception):  # only the timing is lost, never the forward
                timing.held(_perf() - t0)

    ddp.register_forward_pre_hook(before)
    # First among the wrapped module's pre-hooks: one registered earlier (a user's, doing
    # work or sleeping) runs after the broadcast and must not be timed as waiting in it
    # (an evaluation's sleep in such a hook was, and its host stall went unflagged).
    inner.register_forward_pre_hook(after, prepend=True)
    return True
