"""One finished profiler window -> the ``profile`` entry of a payload (pure; no torch).

Runs on the agent's profiler thread, never on the training thread. Input: the loaded
Chrome trace of ``profile_steps`` consecutive steps (see :mod:`stepwatch.profiler.trace` for the
classification rules); output: plain JSON-ready values.

What the entry holds, per profiled step (arrays of ``n_steps``):
the step time and its six parts (compute only, copies, communication overlapped,
communication exposed, data wait, idle; they sum to the step time,
:mod:`stepwatch.profiler.breakdown`). ``copy_s`` is optional on the wire (an entry
without it means no copies), so older agents' entries stay valid.

Per window:

``collectives``
    Per operation type (the closed set of :func:`stepwatch.profiler.trace.normalize_op`): count,
    bytes (``None`` as soon as one collective's size is unknown) and a log-bucket sketch
    of the durations in seconds (:class:`stepwatch.sketch.LogSketch`, 1% relative error).
``arrivals``
    Per process group: for each collective, the step it belongs to, a key, and its
    host-clock enter and end times (seconds relative to ``t0``, a Unix time). The
    collector lines up the same collective across the ranks of the group to split its
    duration into *wait* (for the last peer to arrive) and *transfer* (after that).
    The key is the group's sequence number when the trace has one for every collective
    of the group (NCCL's ``record_param_comms`` ``Seq``), else the collective's order
    within its step and group: gloo writes no sequence number, and every rank of a group
    runs the same collectives in the same order (DDP, FSDP and NCCL all require it).
    "Enter" is when the collective starts to run: the gloo operation's start on its
    worker thread, the NCCL kernel's start on the device. Both sit on the host's
    Unix clock in the trace (:func:`stepwatch.profiler.chrome.unix_base_us`).
``top_ops``
    The ten operations with the most *self* time per step: ATen CPU ops on the training
    thread (CPU path) or GPU kernels (CUDA path), names cut to 96 characters.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping, Sequence
from typing import Any

from ..sketch import LogSketch
from .breakdown import Interval, StepBreakdown, breakdown
from .chrome import TraceEvent, events_from_chrome_trace, unix_base_us
from .trace import CollectiveRecord, WindowTrace, classify_events, main_thread

__all__ = ["MAX_ARRIVALS", "MAX_TOP_OPS", "assemble_entry", "build_entry", "top_ops"]

MAX_TOP_OPS = 10
MAX_ARRIVALS = 1024
"""Most collectives per group and window whose arrival times are shipped (the first ones,
in order, so every rank ships the same ones)."""
OP_NAME_CHARS = 96
SKETCH_ALPHA = 0.01
_GPU_WORK_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})


def _select_steps(w: WindowTrace, first_step: int, n_steps: int) -> list[int]:
    """Indices of the window's steps ``first_step .. first_step + n_steps - 1``.

    The agent numbers ``ProfilerStep#N`` with the real step numbers; when the names do
    not match (a trace from elsewhere) the first ``n_steps`` steps are taken in order.
    """
    numbers = w.step_numbers
    if len(numbers) == len(w.steps):
        want = set(range(first_step, first_step + n_steps))
        idx = [i for i, n in enumerate(numbers) if n in want]
        if idx:
            return idx
    return list(range(min(n_steps, len(w.steps))))


def _step_of(starts: Sequence[float], steps: Sequence[Interval], t: float) -> int | None:
    i = bisect_right(starts, t) - 1
    if i >= 0 and t < steps[i][1]:
        return i
    return None


def _collective_summary(recs: Sequence[CollectiveRecord]) -> list[dict[str, Any]]:
    by_op: dict[str, tuple[LogSketch, list[int | None]]] = {}
    for r in recs:
        sk, sizes = by_op.setdefault(r.op, (LogSketch(SKETCH_ALPHA), []))
        sk.add(r.dur_us * 1e-6)
        sizes.append(r.bytes)
    out = []
    for op in sorted(by_op):
        sk, sizes = by_op[op]
        known = [b for b in sizes if b is not None]
        out.append(
            {
                "op": op,
                "count": sk.count,
                "bytes": sum(known) if len(known) == len(sizes) else None,
                "duration": sk.to_dict(),
            }
        )
    return out


def _arrivals(
    recs: Sequence[tuple[int, CollectiveRecord]], step_numbers: Sequence[int], base_us: float, t0_us: float
) -> list[dict[str, Any]]:
    groups: dict[tuple[str, tuple[int, ...] | None], list[tuple[int, CollectiveRecord]]] = {}
    for j, r in recs:
        groups.setdefault((r.group_name or "", r.group_ranks), []).append((j, r))
    out = []
    for (name, ranks), items in sorted(groups.items(), key=lambda kv: kv[0][0]):
        items = items[:MAX_ARRIVALS]
        by_seq = all(r.seq is not None for _, r in items)
        order: dict[int, int] = {}
        keys: list[int] = []
        for j, r in items:
            if by_seq:
                keys.append(int(r.seq or 0))
            else:
                keys.append(order.get(j, 0))
                order[j] = order.get(j, 0) + 1
        size = items[0][1].group_size if items else None
        out.append(
            {
                "group": name,
                "ranks": list(ranks) if ranks is not None else None,
                "size": size,
                "key_kind": "seq" if by_seq else "order",
                "step": [step_numbers[j] for j, _ in items],
                "op": [r.op for _, r in items],
                "key": keys,
                "enter": [round((base_us + r.start_us - t0_us) * 1e-6, 7) for _, r in items],
                "end": [round((base_us + r.start_us + r.dur_us - t0_us) * 1e-6, 7) for _, r in items],
            }
        )
    return out


def _self_times(events: Sequence[TraceEvent]) -> dict[str, list[float]]:
    """Self time (duration minus directly nested children) of events on one thread."""
    out: dict[str, list[float]] = {}
    stack: list[tuple[float, str, float, list[float]]] = []  # (end, name, dur, [children sum])

    def pop() -> None:
        _, name, dur, child = stack.pop()
        acc = out.setdefault(name, [0.0, 0.0])
        acc[0] += max(0.0, dur - child[0])
        acc[1] += 1

    for ev in sorted(events, key=lambda e: (e.start_us, -e.dur_us)):
        while stack and stack[-1][0] <= ev.start_us:
            pop()
        if stack:
            stack[-1][3][0] += ev.dur_us
        stack.append((ev.end_us, ev.name, ev.dur_us, [0.0]))
    while stack:
        pop()
    return out


def top_ops(
    events: Sequence[TraceEvent], span: Interval, device: str, n_steps: int, limit: int = MAX_TOP_OPS
) -> list[dict[str, Any]]:
    """The ``limit`` operations with the most self time per step inside ``span``."""
    lo, hi = span
    if device == "cuda":
        work = [e for e in events if e.cat.lower() in _GPU_WORK_CATS and lo <= e.start_us < hi]
        totals: dict[str, list[float]] = {}
        for e in work:
            acc = totals.setdefault(e.name, [0.0, 0.0])
            acc[0] += e.dur_us
            acc[1] += 1
    else:
        main = main_thread(events)
        ops = [e for e in events if e.cat == "cpu_op" and (e.pid, e.tid) == main and lo <= e.start_us < hi]
        totals = _self_times(ops)
    per = max(1, n_steps)
    ranked = sorted(totals.items(), key=lambda kv: (-kv[1][0], kv[0]))[:limit]
    return [
        {"name": name[:OP_NAME_CHARS], "self_s": t * 1e-6 / per, "count": c / per}
        for name, (t, c) in ranked
        if t > 0
    ]


def build_entry(trace: Mapping[str, object], *, first_step: int, n_steps: int) -> dict[str, Any]:
    """The payload entry of one profiler window (see the module docstring).

    Raises ``ValueError`` when the trace holds none of the window's steps.
    """
    events = events_from_chrome_trace(trace)
    w = classify_events(events, trace.get("distributedInfo"))
    idx = _select_steps(w, first_step, n_steps)
    if not idx:
        raise ValueError("the profiler trace holds no ProfilerStep of the window")
    steps = [w.steps[i] for i in idx]
    named = len(w.step_numbers) == len(w.steps)
    numbers = [w.step_numbers[i] if named else first_step + k for k, i in enumerate(idx)]
    parts = [breakdown(s, w.compute, w.comm, w.data_wait, w.copies).scaled(1e-6) for s in steps]
    starts = [s[0] for s in steps]
    placed: list[tuple[int, CollectiveRecord]] = []
    for r in w.collectives:
        j = _step_of(starts, steps, r.start_us)
        if j is not None:
            placed.append((j, r))
    span = (steps[0][0], steps[-1][1])
    return assemble_entry(
        numbers=numbers,
        device=w.device,
        parts=parts,
        collectives=placed,
        base_us=unix_base_us(trace),
        t0_us=steps[0][0],
        top=top_ops(events, span, w.device, len(steps)),
    )


def assemble_entry(
    *,
    numbers: Sequence[int],
    device: str,
    parts: Sequence[StepBreakdown],
    collectives: Sequence[tuple[int, CollectiveRecord]],
    base_us: float,
    t0_us: float,
    top: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """The entry from per-step parts (seconds) and the collectives placed in their steps.

    ``collectives`` pairs each record with the index of its step in ``numbers``; record
    times are on the trace's clock (microseconds), ``base_us`` maps them to Unix time and
    ``t0_us`` (same clock) is the first step's start. The simulator builds its windows
    through this too, so what it sends is what the agent sends.
    """
    base_t0 = base_us + t0_us
    return {
        "first_step": numbers[0],
        "n_steps": len(parts),
        "device": device,
        "t0": base_t0 * 1e-6,
        "time_s": [b.step_s for b in parts],
        "compute_s": [b.compute_s for b in parts],
        "copy_s": [b.copy_s for b in parts],
        "comm_overlapped_s": [b.comm_overlapped_s for b in parts],
        "comm_exposed_s": [b.comm_exposed_s for b in parts],
        "data_wait_s": [b.data_wait_s for b in parts],
        "idle_s": [b.idle_s for b in parts],
        "top_ops": [dict(o) for o in top],
        "collectives": _collective_summary([r for _, r in collectives]),
        "arrivals": _arrivals(collectives, numbers, base_us, base_t0),
    }
