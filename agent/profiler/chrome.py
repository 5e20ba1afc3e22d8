"""Reading Kineto's Chrome-trace JSON: the file, its complete events, its clock base.

Kept apart from :mod:`.trace`, which classifies the events into the intervals of the
breakdown: this part only knows the file format (``"ph": "X"`` events with ``ts``/``dur``
in microseconds, ``baseTimeNanoseconds``), so ``stepwatch trace`` and the tests read any
trace through it, and it imports nothing from torch.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from .breakdown import Interval

__all__ = [
    "MAX_TRACE_BYTES",
    "TraceEvent",
    "events_from_chrome_trace",
    "finite_number",
    "load_chrome_trace",
    "trace_from_profiler",
    "unix_base_us",
]

MAX_TRACE_BYTES = 64 * 2**20
"""Largest exported trace the agent parses in the training process. Real windows of a few
GPU steps are 5-50 MB of JSON (HTA's test traces: 26-54 MB for 5 steps); Python's
parsed JSON takes several times that, transiently, so a bigger trace is skipped."""


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


class _ExportsChromeTrace(Protocol):
    def export_chrome_trace(self, path: str) -> object: ...


# -- reading ------------------------------------------------------------------------


def load_chrome_trace(path: str | os.PathLike[str], *, max_bytes: int | None = None) -> dict[str, object]:
    """Read a Chrome-trace JSON file (``.json`` or ``.json.gz``).

    ``max_bytes`` refuses (``ValueError``) a file larger than that before reading it:
    parsed JSON takes several times its size in memory.
    """
    p = Path(path)
    if max_bytes is not None and (size := p.stat().st_size) > max_bytes:
        raise ValueError(f"trace is {size / 2**20:.0f} MiB, over the {max_bytes / 2**20:.0f} MiB cap")
    if p.suffix == ".gz":
        with gzip.open(p, "rt", encoding="utf-8") as fh:
            data = json.load(fh)
    else:
        with p.open(encoding="utf-8") as fh:
            data = json.load(fh)
    if not isinstance(data, dict):
        raise ValueError(f"{p}: a Chrome trace is a JSON object, got {type(data).__name__}")
    return data


def trace_from_profiler(
    prof: _ExportsChromeTrace,
    *,
    max_bytes: int = MAX_TRACE_BYTES,
    keep: list[bytes] | None = None,
    keep_max: int = 0,
) -> dict[str, object]:
    """Export a finished ``torch.profiler.profile`` to a temporary file and load it.

    Kineto only writes its trace to a file, so this is the way to its JSON; the
    file is removed afterwards. Call it off the training thread. A trace over
    ``max_bytes`` is not parsed (``ValueError``): the window is then skipped. With
    ``keep``, the file gzipped is appended to it when that is at most ``keep_max`` bytes
    (a capture's raw trace, uploaded for a person to open in Perfetto).
    """
    fd, name = tempfile.mkstemp(prefix="stepwatch-trace-", suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(name)
        if keep is not None and os.path.getsize(name) <= max_bytes:
            with open(name, "rb") as f:
                packed = gzip.compress(f.read(), compresslevel=6)
            if len(packed) <= keep_max:
                keep.append(packed)
        return load_chrome_trace(name, max_bytes=max_bytes)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(name)


def finite_number(v: object) -> float | None:
    """``v`` as a finite float, or None for anything else (bools, NaN, strings)."""
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
        ts = finite_number(ev.get("ts"))
        dur = finite_number(ev.get("dur"))
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


def unix_base_us(trace: Mapping[str, object]) -> float:
    """What to add to a trace's ``ts`` values to get Unix-epoch microseconds.

    Kineto (torch >= 2.0) writes ``ts`` relative to ``baseTimeNanoseconds``, itself a
    Unix time (measured: their sum is the wall-clock time of the run); older traces
    carry absolute Unix microseconds and no base. Host and (CUPTI-converted) device
    timestamps share this clock, which is what lets the collector compare the
    collective arrival times of ranks that share a host clock.
    """
    base = finite_number(trace.get("baseTimeNanoseconds"))
    return 0.0 if base is None else base / 1000.0
