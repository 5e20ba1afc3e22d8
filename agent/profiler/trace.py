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
    *communication* = NCCL kernels (name contains ``nccl``, any case).
    *compute* = every other kernel, plus memcpy and memset: the device is busy with
    non-communication work, so "idle" keeps meaning "the GPU had nothing to do"
    (as in HTA's temporal breakdown). ``cuda_sync`` and ``gpu_user_annotation``
    events are not work and are ignored.
    *steps* = device-side boundaries: a host ``ProfilerStep`` boundary ``b`` maps to
    ``max(b, latest end of GPU work launched before b)``, which is what a CUDA event
    recorded at ``b`` measures (DESIGN §3). Launch times come from the
    ``cuda_runtime``/``cuda_driver`` event with the same ``correlation``.
    *data wait* = loader spans on the main thread minus device-busy time: a host
    that is in the loader while the GPU still works through queued kernels is not
    stalling training, only device idle time spent waiting for the loader is.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import math
import os
import re
import tempfile
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from .breakdown import Interval, StepBreakdown, breakdown, subtract, union

__all__ = [
    "DATA_WAIT_SPAN",
    "CollectiveRecord",
    "TraceEvent",
    "WindowTrace",
    "classify_events",
    "events_from_chrome_trace",
    "is_nccl_kernel",
    "load_chrome_trace",
    "main_thread",
    "normalize_op",
    "parse_chrome_trace",
    "trace_from_profiler",
    "unix_base_us",
    "window_breakdown",
]

DATA_WAIT_SPAN = "stepwatch.data_wait"
"""Name of the ``record_function`` span the agent's loader wrapper emits."""

_STEP_RE = re.compile(r"ProfilerStep#(\d+)\Z")
_LOADER_PREFIX = "enumerate(DataLoader)"
_HOST_LAUNCH_PREFIXES = ("c10d::", "record_param_comms", "nccl:")
_BACKEND_OP_PREFIXES = ("gloo:", "mpi:", "ucc:")
_GPU_WORK_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
_LAUNCH_CATS = frozenset({"cuda_runtime", "cuda_driver"})

# Bytes per element, keyed by lower-cased dtype names as they appear in traces:
# c10 ScalarType names in record_param_comms ("Float", "BFloat16") and C++ type
# names in "Input type" ("float", "c10::BFloat16", "long int").
_DTYPE_BYTES: dict[str, int] = {
    "float": 4,
    "float32": 4,
    "double": 8,
    "float64": 8,
    "half": 2,
    "float16": 2,
    "c10::half": 2,
    "bfloat16": 2,
    "c10::bfloat16": 2,
    "long": 8,
    "long int": 8,
    "int64": 8,
    "int64_t": 8,
    "int": 4,
    "int32": 4,
    "short": 2,
    "short int": 2,
    "int16": 2,
    "byte": 1,
    "uint8": 1,
    "unsigned char": 1,
    "char": 1,
    "int8": 1,
    "signed char": 1,
    "bool": 1,
    "complexfloat": 8,
    "c10::complex<float>": 8,
    "complexdouble": 16,
    "c10::complex<double>": 16,
}

# Canonical op names, matched as prefixes of the name with "_" removed, first match wins.
_OP_TABLE: tuple[tuple[str, str], ...] = (
    ("allreduce", "all_reduce"),
    ("reducescatter", "reduce_scatter"),
    ("allgather", "all_gather"),
    ("alltoall", "all_to_all"),
    ("broadcast", "broadcast"),
    ("sendrecv", "send_recv"),
    ("send", "send"),
    ("recv", "recv"),
    ("monitoredbarrier", "barrier"),
    ("barrier", "barrier"),
    ("reduce", "reduce"),
    ("gather", "gather"),
    ("scatter", "scatter"),
)
_KERNEL_PREFIXES = ("nccldevkernel_", "ncclkernel_")
_NAME_PREFIXES = ("c10d::", "gloo:", "nccl:", "mpi:", "ucc:")


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One complete (``"ph": "X"``) event of a Chrome trace, times in microseconds."""

    name: str
    cat: str
    start_us: float
    dur_us: float
    pid: int | str
    tid: int | str
    args: Mapping[str, object]

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us

    @property
    def span(self) -> Interval:
        return (self.start_us, self.start_us + self.dur_us)


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


class _ExportsChromeTrace(Protocol):
    def export_chrome_trace(self, path: str) -> object: ...


# -- reading ------------------------------------------------------------------------


def load_chrome_trace(path: str | os.PathLike[str]) -> dict[str, object]:
    """Read a Chrome-trace JSON file (``.json`` or ``.json.gz``)."""
    p = Path(path)
    if p.suffix == ".gz":
        with gzip.open(p, "rt", encoding="utf-8") as fh:
            data = json.load(fh)
    else:
        with p.open(encoding="utf-8") as fh:
            data = json.load(fh)
    if not isinstance(data, dict):
        raise ValueError(f"{p}: a Chrome trace is a JSON object, got {type(data).__name__}")
    return data


def trace_from_profiler(prof: _ExportsChromeTrace) -> dict[str, object]:
    """Export a finished ``torch.profiler.profile`` to a temporary file and load it.

    Kineto only writes its trace to a file, so this is the way to its JSON; the
    file is removed afterwards. Call it off the training thread.
    """
    fd, name = tempfile.mkstemp(prefix="stepwatch-trace-", suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(name)
        return load_chrome_trace(name)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(name)


def _num(v: object) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def events_from_chrome_trace(trace: Mapping[str, object]) -> list[TraceEvent]:
    """The complete events of a loaded Chrome trace; malformed entries are skipped.

    Flow (``s``/``f``), metadata (``M``) and instant (``i``) events carry no
    duration and are dropped. A trace without a ``traceEvents`` list raises
    ``ValueError``.
    """
    raw = trace.get("traceEvents")
    if not isinstance(raw, list):
        raise ValueError("Chrome trace has no 'traceEvents' list")
    out: list[TraceEvent] = []
    for ev in raw:
        if not isinstance(ev, dict) or ev.get("ph") != "X":
            continue
        ts = _num(ev.get("ts"))
        dur = _num(ev.get("dur"))
        name = ev.get("name")
        if ts is None or dur is None or not isinstance(name, str):
            continue
        cat = ev.get("cat")
        pid = ev.get("pid")
        tid = ev.get("tid")
        args = ev.get("args")
        out.append(
            TraceEvent(
                name=name,
                cat=cat if isinstance(cat, str) else "",
                start_us=ts,
                dur_us=max(0.0, dur),
                pid=pid if isinstance(pid, int | str) and not isinstance(pid, bool) else str(pid),
                tid=tid if isinstance(tid, int | str) and not isinstance(tid, bool) else str(tid),
                args=args if isinstance(args, dict) else {},
            )
        )
    return out


# -- names ---------------------------------------------------------------------------


def is_nccl_kernel(ev: TraceEvent) -> bool:
    """A GPU kernel that belongs to NCCL/RCCL (``ncclDevKernel_*``, ``ncclKernel_*``, ...)."""
    return ev.cat.lower() == "kernel" and "nccl" in ev.name.lower()


def normalize_op(name: str) -> str:
    """Canonical collective name from a gloo/c10d/NCCL event or ``Collective name`` value.

    Returns one of ``all_reduce``, ``reduce_scatter``, ``all_gather``, ``all_to_all``,
    ``broadcast``, ``send``, ``recv``, ``send_recv``, ``barrier``, ``reduce``,
    ``gather``, ``scatter``, or ``other``: a closed set keeps label cardinality bounded.
    NCCL runs all_to_all as grouped send/recv, so a bare ``SendRecv`` kernel is
    ``send_recv`` unless its ``Collective name`` says more.
    """
    low = name.split("(", 1)[0].strip().lower()
    for prefix in _KERNEL_PREFIXES:
        if low.startswith(prefix):
            low = low[len(prefix) :].split("_", 1)[0]
            break
    else:
        for prefix in _NAME_PREFIXES:
            if low.startswith(prefix):
                low = low[len(prefix) :]
                break
    compact = low.replace("_", "")
    for key, op in _OP_TABLE:
        if compact.startswith(key):
            return op
    return "other"


def _dtype_bytes(v: object) -> int | None:
    if not isinstance(v, str):
        return None
    return _DTYPE_BYTES.get(v.strip().lower())


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


def _product(dims: object) -> int | None:
    if not isinstance(dims, list) or not all(_int(d) is not None for d in dims):
        return None
    n = 1
    for d in dims:
        n *= _int(d) or 0
    return n


# -- classification ------------------------------------------------------------------


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
        nbytes: int | None = None
        types = ev.args.get("Input type")
        dims = ev.args.get("Input Dims")
        if isinstance(types, list) and isinstance(dims, list) and types and len(types) == len(dims):
            total = 0
            for t, d in zip(types, dims, strict=True):
                size = _dtype_bytes(t)
                n = _product(d)
                if size is None or n is None:
                    total = -1
                    break
                total += size * n
            if total >= 0:
                nbytes = total
                if op == "all_gather":
                    nbytes = None if group.size is None else total * group.size
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


def _nccl_records(
    kernels: Sequence[TraceEvent], param_comms: Mapping[int, TraceEvent]
) -> list[CollectiveRecord]:
    out: list[CollectiveRecord] = []
    for ev in sorted(kernels, key=lambda e: e.start_us):
        a = ev.args
        ext = _int(a.get("External id"))
        host = param_comms.get(ext) if ext is not None else None
        meta: Mapping[str, object] = a if "Collective name" in a or host is None else host.args
        coll = meta.get("Collective name")
        op = normalize_op(coll) if isinstance(coll, str) else "other"
        if op == "other":  # no usable "Collective name": fall back on the kernel's name
            op = normalize_op(ev.name)
        size = _dtype_bytes(meta.get("dtype"))
        n_in = _int(meta.get("In msg nelems"))
        n_out = _int(meta.get("Out msg nelems"))
        nelems = max((n for n in (n_in, n_out) if n is not None), default=None)
        group_name = meta.get("Process Group Name")
        out.append(
            CollectiveRecord(
                op=op,
                start_us=ev.start_us,
                dur_us=ev.dur_us,
                bytes=None if size is None or nelems is None else size * nelems,
                group_name=None if group_name is None else str(group_name).strip('"'),
                group_size=_int(meta.get("Group size")),
                group_ranks=_ranks(meta.get("Process Group Ranks")),
                seq=None if host is None else _int(host.args.get("Seq")),
            )
        )
    return out


def _device_steps(
    host_steps: Sequence[Interval], gpu: Sequence[TraceEvent], launch_at: Mapping[int, float]
) -> list[Interval]:
    """Map host step spans to device-side spans (see the module docstring)."""
    work: list[tuple[float, float]] = []  # (launch time, end on device)
    for ev in gpu:
        corr = _int(ev.args.get("correlation"))
        launched = launch_at.get(corr, ev.start_us) if corr is not None else ev.start_us
        work.append((min(launched, ev.start_us), ev.end_us))
    work.sort()
    launches = [w[0] for w in work]
    prefix_end: list[float] = []
    best = -math.inf
    for _, end in work:
        best = max(best, end)
        prefix_end.append(best)

    def device_time(b: float) -> float:
        i = bisect_right(launches, b) - 1  # work launched at or before b
        return b if i < 0 else max(b, prefix_end[i])

    out: list[Interval] = []
    for s, e in host_steps:
        ds, de = device_time(s), device_time(e)
        out.append((ds, max(ds, de)))
    return out


def classify_events(events: Sequence[TraceEvent], distributed_info: object = None) -> WindowTrace:
    """Apply the classification rules of the module docstring to parsed events."""
    main = main_thread(events)

    def on_main(ev: TraceEvent) -> bool:
        return main is not None and (ev.pid, ev.tid) == main

    step_events = sorted(
        (ev for ev in events if on_main(ev) and _STEP_RE.match(ev.name)), key=lambda e: e.start_us
    )
    host_steps = [ev.span for ev in step_events]
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

    nccl = [ev for ev in gpu if is_nccl_kernel(ev)]
    comm = union(ev.span for ev in nccl)
    compute = union(ev.span for ev in gpu if not is_nccl_kernel(ev))
    launch_at: dict[int, float] = {}
    for ev in events:
        if ev.cat in _LAUNCH_CATS:
            corr = _int(ev.args.get("correlation"))
            if corr is not None:
                launch_at[corr] = ev.start_us
    param_comms: dict[int, TraceEvent] = {}
    for ev in events:
        if ev.name == "record_param_comms":
            ext = _int(ev.args.get("External id"))
            if ext is not None:
                param_comms[ext] = ev
    records = sorted(_nccl_records(nccl, param_comms) + gloo, key=lambda r: r.start_us)
    return WindowTrace(
        steps=_device_steps(host_steps, gpu, launch_at),
        compute=compute,
        comm=comm,
        data_wait=subtract(host_wait, union(compute, comm)),
        collectives=records,
        device="cuda",
        step_numbers=step_numbers,
    )


def unix_base_us(trace: Mapping[str, object]) -> float:
    """What to add to a trace's ``ts`` values to get Unix-epoch microseconds.

    Kineto (torch >= 2.0) writes ``ts`` relative to ``baseTimeNanoseconds``, itself a
    Unix time (measured: their sum is the wall-clock time of the run); older traces
    carry absolute Unix microseconds and no base. Host and (CUPTI-converted) device
    timestamps share this clock, which is what lets the collector compare the
    collective arrival times of ranks that share a host clock.
    """
    base = _num(trace.get("baseTimeNanoseconds"))
    return 0.0 if base is None else base / 1000.0


def parse_chrome_trace(trace: Mapping[str, object]) -> WindowTrace:
    """Classify a loaded Kineto Chrome trace (one process, one profiler window)."""
    return classify_events(events_from_chrome_trace(trace), trace.get("distributedInfo"))


def window_breakdown(trace: WindowTrace) -> list[StepBreakdown]:
    """The breakdown of every step of the window, in seconds."""
    return [breakdown(step, trace.compute, trace.comm, trace.data_wait).scaled(1e-6) for step in trace.steps]
