"""Turn a torch.profiler (Kineto) Chrome trace into the intervals of the time breakdown.

The agent captures a short profiler window every N steps, exports it with
``prof.export_chrome_trace(path)`` and parses it here, off the training thread.
Parsing reads plain JSON, so this module imports nothing from torch.

What torch 2.13 writes (measured on a 2-rank gloo DDP job, CPU only; see
``tests/fixtures/make_cpu_trace.py``): complete events (``"ph": "X"``) with
``name``, ``cat``, ``ts`` and ``dur`` in microseconds, ``pid``/``tid`` and ``args``.

* Steps: ``ProfilerStep#N`` (``user_annotation``) on the thread that calls
  ``prof.step()``: the *main thread* below.
* Loader: ``enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__``
  (``user_annotation``) around each ``next()``; we also emit our own
  ``stepwatch.data_wait`` span.
* Communication on gloo: ``c10d::allreduce_`` / ``c10d::broadcast_`` / ... (``cpu_op``)
  is the launch on the main thread; ``gloo:all_reduce`` / ``gloo:broadcast`` / ...
  (``user_annotation``) is the operation itself on a ``pt_gloo_runloop`` worker
  thread (``gloo:send``/``gloo:recv`` run on the calling thread). Their args carry
  ``Input type`` (e.g. ``float``, ``c10::BFloat16``) and ``Input Dims`` with
  ``record_shapes=True``, nothing else. gloo runs ``reduce_scatter`` as
  ``gloo:all_reduce``. No ``record_param_comms`` event is written for gloo, so group
  name, ranks and sequence number come only from the trace's top-level
  ``distributedInfo.pg_config`` (used when it lists exactly one group).
* On CUDA, NCCL work shows as GPU kernels named ``ncclDevKernel_*`` / ``ncclKernel_*``;
  Kineto copies the ``record_param_comms`` metadata (``Collective name``,
  ``In msg nelems``, ``Out msg nelems``, ``Group size``, ``dtype``,
  ``Process Group Name``, ``Process Group Ranks``) onto the kernel, and the kernel's
  ``External id`` names the ``record_param_comms`` CPU op, whose ``Seq`` we read.

Classification rules (documented because the breakdown depends on them):

CPU (no GPU activity in the trace)
    *compute* = union of ``cpu_op`` spans on the main thread, minus the
    communication launches on that thread and minus data wait. Only ``cpu_op``
    counts: ``user_annotation`` spans (``DistributedDataParallel.forward``, user
    ``record_function`` blocks) can wrap blocking waits, and ``python_function``
    spans (``with_stack``) cover the whole loop; either would hide idle time. Python
    time between ATen ops is host overhead, which DESIGN §3 counts as idle.
    *communication* = union of the backend operations (``gloo:*`` on any thread) and
    the launches on the main thread (``c10d::*``, ``record_param_comms``).
    *data wait* = loader spans on the main thread (a loader iterated by a helper
    thread does not block training).
    *steps* = the ``ProfilerStep#N`` spans.

CUDA (any ``kernel`` / ``gpu_memcpy`` / ``gpu_memset`` event)
    *communication* = device work launched inside a communication host op, else a
    kernel with a communication library's name (the table and its order of sources
    are in :mod:`stepwatch.profiler.collectives`: ``c10d::*``, ``nccl:*``,
    ``symm_mem::*`` ..., then NCCL/RCCL, NVSHMEM, DeepEP, custom all-reduce kernels).
    A launch is matched to its host op by the ``correlation`` of its
    ``cuda_runtime``/``cuda_driver`` event and by time on the launching thread.
    One collective record per launching host op (or per kernel when no op launched
    it), with op name and bytes from the kernel's metadata, else from the host ops.
    *compute* = every other kernel (kernels only, as HTA defines compute).
    *copies* = memcpy and memset not launched by a collective: their own part of the
    breakdown, so a copy-bound step is not mistaken for compute or for idle.
    ``cuda_sync`` and ``gpu_user_annotation`` events are not work and are ignored.
    *steps* = device-side boundaries: a host ``ProfilerStep`` boundary ``b`` maps to
    ``max(b, latest end of GPU work launched before b)``, which is what a CUDA event
    recorded at ``b`` measures (DESIGN §3). Launch times come from the launch event
    with the same ``correlation``. Work without a launch in the trace whose
    correlation id is below every launch's was launched before the profiler started
    (correlation ids grow with every launch): it belongs to no profiled step, so the
    first step starts when that tail of the previous step has drained, not at the
    host boundary (which would hand the first step a whole step of foreign work).
    Its device time is kept as ``before_window_us``. Where the trace holds none of
    that tail (CUPTI records no kernel launched before it started: seen on an H200 with
    torch 2.11, the agent's later windows there), the training thread's first launch in
    the window tells it: if its work started more than ``QUEUED_US`` after the call
    returned, and that wait is at least half the time since the window's start, the
    device was busy with the tail until then, so no step boundary maps before that
    start, and the time from the window's start to it counts in ``before_window_us``
    (inferred, not measured). A first launch that is synchronous (a pageable copy,
    ``.item()``) cannot show a wait, and the tail then stays in the first step. The
    profiler's own start is no step's either: the first step's host span opens when
    CUPTI's first buffer requests (``overhead`` events) that held the training thread
    have ended.
    *data wait* = loader spans on the main thread minus device-busy time: a host
    that is in the loader while the GPU still works through queued kernels is not
    stalling training, only device idle time spent waiting for the loader is.

Reading the file and its events is :mod:`.chrome`; what is left here is the
classification, documented above next to the code that applies it (which is why the
module runs past 400 lines: about a quarter of it is these rules).
"""

from __future__ import annotations

import math
import re
from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from .breakdown import Interval, StepBreakdown, breakdown, subtract, union
from .chrome import TraceEvent, events_from_chrome_trace
from .collectives import (
    dtype_bytes,
    host_op_bytes,
    is_comm_kernel_name,
    is_launcher,
    normalize_op,
    tensor_bytes,
)

__all__ = [
    "DATA_WAIT_SPAN",
    "CollectiveRecord",
    "WindowTrace",
    "classify_events",
    "main_thread",
    "parse_chrome_trace",
    "window_breakdown",
]

DATA_WAIT_SPAN = "stepwatch.data_wait"
"""Name of the ``record_function`` span the agent's loader wrapper emits."""

_STEP_RE = re.compile(r"ProfilerStep#(\d+)\Z")
_LOADER_PREFIX = "enumerate(DataLoader)"
_HOST_LAUNCH_PREFIXES = ("c10d::", "record_param_comms", "nccl:")
_HOST_CATS = frozenset({"cpu_op", "user_annotation"})
_BACKEND_OP_PREFIXES = ("gloo:", "mpi:", "ucc:")
_GPU_WORK_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
_LAUNCH_CATS = frozenset({"cuda_runtime", "cuda_driver"})


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective as this rank saw it; ``None`` where the trace does not say.

    ``bytes`` follows the nccl-tests convention: the larger of the input and output
    buffers (the gathered output of an all_gather, the full input of a
    reduce_scatter).
    """

    op: str
    start_us: float
    dur_us: float
    bytes: int | None
    group_name: str | None
    group_size: int | None
    group_ranks: tuple[int, ...] | None
    seq: int | None


@dataclass(frozen=True)
class WindowTrace:
    """The intervals of one profiler window, in the trace's microseconds.

    ``compute``, ``comm`` and ``data_wait`` are canonical (sorted, disjoint) lists.
    """

    steps: list[Interval]
    compute: list[Interval]
    comm: list[Interval]
    data_wait: list[Interval]
    collectives: list[CollectiveRecord]
    device: str  # "cpu" | "cuda"
    step_numbers: list[int] = field(default_factory=list)  # N of each ProfilerStep#N
    copies: list[Interval] = field(default_factory=list)  # memcpy / memset not launched by a collective
    #: Device time of work launched before the window (no step of the window holds it).
    before_window_us: float = 0.0


# -- values --------------------------------------------------------------------------


def _int(v: object) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str):
        try:
            return int(v.strip().strip('"'))
        except ValueError:
            return None
    return None


def _ranks(v: object) -> tuple[int, ...] | None:
    if isinstance(v, list | tuple):
        vals = [_int(x) for x in v]
        return None if any(x is None for x in vals) else tuple(x for x in vals if x is not None)
    if isinstance(v, str):
        return tuple(int(x) for x in re.findall(r"-?\d+", v))
    return None


@dataclass(frozen=True)
class _Group:
    name: str | None
    size: int | None
    ranks: tuple[int, ...] | None


def _single_group(distributed_info: object) -> _Group:
    """The process group of every gloo collective when the trace lists exactly one."""
    if not isinstance(distributed_info, Mapping):
        return _Group(None, None, None)
    pgs = distributed_info.get("pg_config")
    if not isinstance(pgs, list) or len(pgs) != 1 or not isinstance(pgs[0], Mapping):
        return _Group(None, None, None)
    pg = pgs[0]
    name = pg.get("pg_name")
    return _Group(
        name=None if name is None else str(name),
        size=_int(pg.get("pg_size")),
        ranks=_ranks(pg.get("ranks")),
    )


def main_thread(events: Sequence[TraceEvent]) -> tuple[int | str, int | str] | None:
    """``(pid, tid)`` of the thread that owns the ``ProfilerStep`` spans (else the busiest)."""
    counts: dict[tuple[int | str, int | str], int] = {}
    for ev in events:
        if ev.cat != "gpu_user_annotation" and _STEP_RE.match(ev.name):
            key = (ev.pid, ev.tid)
            counts[key] = counts.get(key, 0) + 1
    if not counts:
        busy: dict[tuple[int | str, int | str], float] = {}
        for ev in events:
            if ev.cat == "cpu_op":
                key = (ev.pid, ev.tid)
                busy[key] = busy.get(key, 0.0) + ev.dur_us
        if not busy:
            return None
        return max(busy, key=lambda k: busy[k])
    return max(counts, key=lambda k: counts[k])


def _is_data_wait(name: str) -> bool:
    return name == DATA_WAIT_SPAN or name.startswith(_LOADER_PREFIX)


def _gloo_records(
    backend_ops: Sequence[TraceEvent], launches: Sequence[TraceEvent], group: _Group
) -> list[CollectiveRecord]:
    launch_starts = [ev.start_us for ev in launches]
    launch_ops = [normalize_op(ev.name) for ev in launches]
    out: list[CollectiveRecord] = []
    for ev in sorted(backend_ops, key=lambda e: e.start_us):
        op = normalize_op(ev.name)
        # gloo runs reduce_scatter as all_reduce: trust the launch that precedes it.
        i = bisect_right(launch_starts, ev.start_us) - 1
        if op == "all_reduce" and i >= 0 and launch_ops[i] == "reduce_scatter":
            op = "reduce_scatter"
        sizes = tensor_bytes(ev.args)
        nbytes = None if sizes is None else sum(sizes)
        if nbytes is not None and op == "all_gather":
            nbytes = None if group.size is None else nbytes * group.size
        out.append(
            CollectiveRecord(
                op=op,
                start_us=ev.start_us,
                dur_us=ev.dur_us,
                bytes=nbytes,
                group_name=group.name,
                group_size=group.size,
                group_ranks=group.ranks,
                seq=None,
            )
        )
    return out


def _launch_chains(
    events: Sequence[TraceEvent], launch_of: Mapping[int, TraceEvent]
) -> dict[int, tuple[TraceEvent, ...]]:
    """correlation -> the communication host ops around its launch, outermost first.

    A sweep per thread over the launcher spans (:func:`collectives.is_launcher`) and the
    launches of that thread, both sorted by start: O((spans + launches) log n).
    """
    spans: dict[tuple[int | str, int | str], list[TraceEvent]] = {}
    for ev in events:
        if ev.cat in _HOST_CATS and is_launcher(ev.name):
            spans.setdefault((ev.pid, ev.tid), []).append(ev)
    by_thread: dict[tuple[int | str, int | str], list[tuple[float, int]]] = {}
    for corr, launch in launch_of.items():
        if (launch.pid, launch.tid) in spans:
            by_thread.setdefault((launch.pid, launch.tid), []).append((launch.start_us, corr))
    out: dict[int, tuple[TraceEvent, ...]] = {}
    for key, launches in by_thread.items():
        ops = sorted(spans[key], key=lambda e: (e.start_us, -e.dur_us))
        launches.sort()
        i = 0
        open_ops: list[TraceEvent] = []
        for t, corr in launches:
            while i < len(ops) and ops[i].start_us <= t:
                open_ops.append(ops[i])
                i += 1
            open_ops = [op for op in open_ops if op.end_us >= t]
            if open_ops:
                out[corr] = tuple(open_ops)
    return out


@dataclass
class _CommWork:
    """Device work of one collective: the kernels one host op launched (or one kernel)."""

    events: list[TraceEvent]
    chain: tuple[TraceEvent, ...]


def _param_comms(
    kernel: TraceEvent, chain: Sequence[TraceEvent], by_ext: Mapping[int, TraceEvent]
) -> tuple[Mapping[str, object], Mapping[str, object]]:
    """``(metadata, host args)`` of a collective's ``record_param_comms`` op: the
    metadata on the kernel itself (torch >= 2.1) or on the op; the op is the one the
    kernel's ``External id`` names, else the one around its launch. ``Seq`` is only
    ever on the op."""
    ext = _int(kernel.args.get("External id"))
    host = by_ext.get(ext) if ext is not None else None
    if host is None:
        host = next((op for op in reversed(chain) if op.name == "record_param_comms"), None)
    host_args: Mapping[str, object] = host.args if host is not None else {}
    return (kernel.args if "Collective name" in kernel.args else host_args), host_args


def _comm_records(
    work: Sequence[_CommWork], param_comms: Mapping[int, TraceEvent], world_size: int | None
) -> list[CollectiveRecord]:
    out: list[CollectiveRecord] = []
    for w in work:
        kernels = [e for e in w.events if e.cat.lower() == "kernel"] or list(w.events)
        first = min(kernels, key=lambda e: e.start_us)
        meta, host_args = _param_comms(first, w.chain, param_comms)
        coll = meta.get("Collective name")
        op = normalize_op(coll) if isinstance(coll, str) else "other"
        for host in reversed(w.chain):  # innermost first: nccl:all_to_all, then c10d::
            if op != "other":
                break
            op = normalize_op(host.name)
        if op == "other":
            op = normalize_op(first.name)
        group_size = _int(meta.get("Group size"))
        size = dtype_bytes(meta.get("dtype"))
        n_in = _int(meta.get("In msg nelems"))
        n_out = _int(meta.get("Out msg nelems"))
        nelems = max((n for n in (n_in, n_out) if n is not None), default=None)
        nbytes = None if size is None or nelems is None else size * nelems
        if nbytes is None:
            nbytes = host_op_bytes([(h.name, h.args) for h in w.chain], op, group_size or world_size)
        group_name = meta.get("Process Group Name")
        start = min(e.start_us for e in w.events)
        end = max(e.end_us for e in w.events)
        out.append(
            CollectiveRecord(
                op=op,
                start_us=start,
                dur_us=end - start,
                bytes=nbytes,
                group_name=None if group_name is None else str(group_name).strip('"'),
                group_size=group_size,
                group_ranks=_ranks(meta.get("Process Group Ranks")),
                seq=_int(host_args.get("Seq")),
            )
        )
    return sorted(out, key=lambda r: r.start_us)


def _after_profiler_start(
    host_steps: list[Interval], events: Sequence[TraceEvent], on_main: Callable[[TraceEvent], bool]
) -> list[Interval]:
    """The window's first step without the profiler's start: CUPTI's first buffer requests
    (``overhead`` events, on a thread of their own) that began before the training
    thread's first event in that step held that thread, while the device had nothing of
    the step to run. On an H200 (torch 2.11, ``tests/fixtures/h200``) they took 2.6-2.8 ms
    of the first step's host span; counted in, a 2.05 ms step read 5.41 ms against the
    2.38 ms its CUDA events measured (3.3 ms of idle that was the profiler's)."""
    if not host_steps:
        return host_steps
    s0, e0 = host_steps[0]
    first_op = min(
        (
            ev.start_us
            for ev in events
            if on_main(ev) and not _STEP_RE.match(ev.name) and s0 <= ev.start_us < e0
        ),
        default=e0,
    )
    opened = max(
        (ev.end_us for ev in events if ev.cat == "overhead" and s0 <= ev.start_us < first_op), default=s0
    )
    return [(min(opened, first_op, e0), e0), *host_steps[1:]]


QUEUED_US = 50.0
"""A kernel that starts this long after its launch call returned waited in its stream's
queue (on an idle device it starts before the call returns or microseconds after: on an
H200 under CUPTI, 5 µs before)."""


def _hidden_tail_end(
    host_steps: Sequence[Interval],
    gpu: Sequence[TraceEvent],
    launch_span: Mapping[int, Interval],
    main_launches: frozenset[int],
) -> float:
    """Where the device finished work the trace does not hold, read off the training
    thread's first launch in the window: its work (the earliest of it: a graph launch has
    many kernels under one correlation) started at that point, having waited more than
    :data:`QUEUED_US` after the call returned, and for at least half the time from the
    window's start (so a step that opens with host work, say 5 ms of data loading, on an
    idle device with a slow launch is not cut). ``-inf``: no such evidence."""
    if not host_steps:
        return -math.inf
    started: dict[int, float] = {}
    for ev in gpu:
        corr = _int(ev.args.get("correlation"))
        if corr is not None and corr in main_launches:
            started[corr] = min(started.get(corr, math.inf), ev.start_us)
    if not started:
        return -math.inf
    corr = min(started, key=lambda c: launch_span[c][0])
    wait = started[corr] - launch_span[corr][1]
    if wait > QUEUED_US and wait >= 0.5 * (started[corr] - host_steps[0][0]):
        return started[corr]
    return -math.inf


def _device_steps(
    host_steps: Sequence[Interval],
    gpu: Sequence[TraceEvent],
    launch_span: Mapping[int, Interval],
    main_launches: frozenset[int],
) -> tuple[list[Interval], float]:
    """Map host step spans to device-side spans (see the module docstring), and the
    device time of the work launched before the window."""
    work: list[tuple[float, float]] = []  # (launch time, end on device)
    first_launch = min(launch_span, default=None)
    before = 0.0
    tail_held = False  # whether the trace holds work launched before the window
    for ev in gpu:
        corr = _int(ev.args.get("correlation"))
        if corr is not None and corr in launch_span:
            launched = min(launch_span[corr][0], ev.start_us)
        elif corr is not None and first_launch is not None and corr < first_launch:
            launched = -math.inf  # launched before the profiler started recording
            before += ev.dur_us
            tail_held = True
        else:
            launched = ev.start_us
        work.append((launched, ev.end_us))
    # A tail the trace does not hold: the window's first launched work queued behind it.
    drained = -math.inf if tail_held else _hidden_tail_end(host_steps, gpu, launch_span, main_launches)
    if drained > -math.inf:
        before += max(0.0, drained - host_steps[0][0])  # inferred: the tail's time in the window
    work.sort()
    launches = [w[0] for w in work]
    prefix_end: list[float] = []
    best = -math.inf
    for _, end in work:
        best = max(best, end)
        prefix_end.append(best)

    def device_time(b: float) -> float:
        i = bisect_right(launches, b) - 1  # work launched at or before b
        return max(b, drained) if i < 0 else max(b, drained, prefix_end[i])

    out: list[Interval] = []
    for s, e in host_steps:
        ds, de = device_time(s), device_time(e)
        out.append((ds, max(ds, de)))
    return out, before


def classify_events(events: Sequence[TraceEvent], distributed_info: object = None) -> WindowTrace:
    """Apply the classification rules of the module docstring to parsed events."""
    main = main_thread(events)

    def on_main(ev: TraceEvent) -> bool:
        return main is not None and (ev.pid, ev.tid) == main

    step_events = sorted(
        (ev for ev in events if on_main(ev) and _STEP_RE.match(ev.name)), key=lambda e: e.start_us
    )
    host_steps = _after_profiler_start([ev.span for ev in step_events], events, on_main)
    step_numbers = [int(m.group(1)) for ev in step_events if (m := _STEP_RE.match(ev.name))]
    host_wait = union(ev.span for ev in events if on_main(ev) and _is_data_wait(ev.name))
    main_launches = sorted(
        (ev for ev in events if on_main(ev) and ev.name.startswith(_HOST_LAUNCH_PREFIXES)),
        key=lambda e: e.start_us,
    )
    backend_ops = [ev for ev in events if ev.name.startswith(_BACKEND_OP_PREFIXES)]
    gloo = _gloo_records(backend_ops, main_launches, _single_group(distributed_info))

    gpu = [ev for ev in events if ev.cat.lower() in _GPU_WORK_CATS]
    if not gpu:
        main_comm = union(ev.span for ev in main_launches)
        comm = union((ev.span for ev in backend_ops), main_comm)
        host_busy = union(ev.span for ev in events if on_main(ev) and ev.cat == "cpu_op")
        compute = subtract(subtract(host_busy, main_comm), host_wait)
        return WindowTrace(
            steps=host_steps,
            compute=compute,
            comm=comm,
            data_wait=host_wait,
            collectives=gloo,
            device="cpu",
            step_numbers=step_numbers,
        )

    launch_of: dict[int, TraceEvent] = {}
    for ev in events:
        if ev.cat in _LAUNCH_CATS:
            corr = _int(ev.args.get("correlation"))
            if corr is not None:
                launch_of[corr] = ev
    chains = _launch_chains(events, launch_of)
    param_comms: dict[int, TraceEvent] = {}
    for ev in events:
        if ev.name == "record_param_comms":
            ext = _int(ev.args.get("External id"))
            if ext is not None:
                param_comms[ext] = ev
    by_op: dict[int, _CommWork] = {}  # id() of the outermost launching host op
    work: list[_CommWork] = []
    compute_ev: list[Interval] = []
    copy_ev: list[Interval] = []
    comm_ev: list[Interval] = []
    for ev in gpu:
        corr = _int(ev.args.get("correlation"))
        chain = chains.get(corr, ()) if corr is not None else ()
        is_kernel = ev.cat.lower() == "kernel"
        if chain:
            comm_ev.append(ev.span)
            w = by_op.get(id(chain[0]))
            if w is None:
                w = by_op[id(chain[0])] = _CommWork([], chain)
                work.append(w)
            w.events.append(ev)
        elif is_kernel and is_comm_kernel_name(ev.name):
            comm_ev.append(ev.span)
            work.append(_CommWork([ev], ()))
        elif is_kernel:
            compute_ev.append(ev.span)
        else:
            copy_ev.append(ev.span)
    compute, copies, comm = union(compute_ev), union(copy_ev), union(comm_ev)
    world = _int(distributed_info.get("world_size")) if isinstance(distributed_info, Mapping) else None
    records = sorted(_comm_records(work, param_comms, world) + gloo, key=lambda r: r.start_us)
    steps, before = _device_steps(
        host_steps,
        gpu,
        {c: ev.span for c, ev in launch_of.items()},
        frozenset(c for c, ev in launch_of.items() if on_main(ev)),
    )
    return WindowTrace(
        steps=steps,
        compute=compute,
        comm=comm,
        data_wait=subtract(host_wait, union(compute, comm, copies)),
        collectives=records,
        device="cuda",
        step_numbers=step_numbers,
        copies=copies,
        before_window_us=before,
    )


def parse_chrome_trace(trace: Mapping[str, object]) -> WindowTrace:
    """Classify a loaded Kineto Chrome trace (one process, one profiler window)."""
    return classify_events(events_from_chrome_trace(trace), trace.get("distributedInfo"))


def window_breakdown(trace: WindowTrace) -> list[StepBreakdown]:
    """The breakdown of every step of the window, in seconds."""
    return [
        breakdown(step, trace.compute, trace.comm, trace.data_wait, trace.copies).scaled(1e-6)
        for step in trace.steps
    ]
