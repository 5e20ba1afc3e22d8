"""``stepwatch trace``: the profiler window's analysis, offline, on trace files people have.

Each file is one rank's Kineto Chrome trace (``.json`` or ``.json.gz``; a directory
stands for the traces in it). Each goes through the same parser and payload builder as
a live window (:mod:`stepwatch.profiler.trace`, :mod:`stepwatch.profiler._entry`), so
what this prints is what the agent would have sent. A trace without ``ProfilerStep``
markers is analysed as one window-long step, from its first to its last event.

With several ranks, their collectives are lined up across ranks into wait and transfer
by the collector's own function (:func:`stepwatch.profiler.lineup.split_wait_transfer`).
Groups whose members the trace does not list (older PyTorch, gloo with several groups)
are taken to be the ranks given; times are each trace's own clock (Unix time from
``baseTimeNanoseconds``), so ranks on different hosts are only as aligned as their
clocks.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..sketch import LogSketch
from ._entry import build_entry
from .chrome import events_from_chrome_trace, load_chrome_trace
from .lineup import GroupArrivals, split_wait_transfer
from .trace import classify_events, main_thread

__all__ = ["PARTS", "RankReport", "Report", "analyse", "find_traces", "render"]

PARTS = ("compute_s", "copy_s", "comm_overlapped_s", "comm_exposed_s", "data_wait_s", "idle_s")
"""The parts of a step, in the order they are shown; they sum to ``time_s``."""


@dataclass
class RankReport:
    """One trace file: its rank, per-step breakdown and per-op collective summary."""

    path: str
    rank: int
    world_size: int | None
    device: str
    steps: list[dict[str, Any]]
    collectives: list[dict[str, Any]]
    before_window_s: float
    entry: dict[str, Any] = field(repr=False)


@dataclass
class Report:
    ranks: list[RankReport]
    #: rank -> {"wait_s", "transfer_s", "collectives", "ops": {op: {...}}}; empty with one rank
    lineup: dict[int, dict[str, Any]]
    #: collectives that could not be lined up (a member of their group is missing)
    unmatched: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "ranks": [
                {
                    "path": r.path,
                    "rank": r.rank,
                    "world_size": r.world_size,
                    "device": r.device,
                    "before_window_s": r.before_window_s,
                    "steps": r.steps,
                    "collectives": r.collectives,
                }
                for r in self.ranks
            ],
            "lineup": {str(k): v for k, v in sorted(self.lineup.items())},
            "unmatched_collectives": self.unmatched,
        }


def find_traces(paths: Iterable[str | Path]) -> list[Path]:
    """The trace files named, directories expanded to their ``*.json`` / ``*.json.gz``."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out.extend(
                sorted(f for f in p.iterdir() if f.name.endswith((".json", ".json.gz")) and f.is_file())
            )
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(f"{p}: no such file or directory")
    if not out:
        raise FileNotFoundError("no .json or .json.gz trace among the paths given")
    return out


def _with_one_step(trace: dict[str, object]) -> dict[str, object]:
    """The trace with a ``ProfilerStep#0`` spanning all of it on the main thread, for
    traces recorded without a schedule (no step markers)."""
    events = events_from_chrome_trace(trace)
    main = main_thread(events)
    if main is None or not events:
        raise ValueError("the trace holds no host thread to analyse")
    lo = min(e.start_us for e in events)
    hi = max(e.end_us for e in events)
    step = {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#0", "ts": lo, "dur": hi - lo}
    step.update(pid=main[0], tid=main[1], args={})
    raw = trace.get("traceEvents")
    return {**trace, "traceEvents": [*(raw if isinstance(raw, list) else []), step]}


def _rank_of(trace: Mapping[str, object], fallback: int) -> tuple[int, int | None]:
    info = trace.get("distributedInfo")
    rank = world = None
    if isinstance(info, Mapping):
        r, w = info.get("rank"), info.get("world_size")
        rank = r if isinstance(r, int) and not isinstance(r, bool) else None
        world = w if isinstance(w, int) and not isinstance(w, bool) else None
    return (fallback if rank is None else rank), world


def _quantile(sk: Mapping[str, Any], q: float) -> float | None:
    return LogSketch.from_dict(dict(sk)).quantile(q)


def _rank_report(path: Path, index: int) -> RankReport:
    trace = load_chrome_trace(path)
    w = classify_events(events_from_chrome_trace(trace), trace.get("distributedInfo"))
    if not w.steps:
        trace = _with_one_step(trace)
        w = classify_events(events_from_chrome_trace(trace), trace.get("distributedInfo"))
    named = len(w.step_numbers) == len(w.steps)
    numbers = w.step_numbers if named else list(range(len(w.steps)))
    first = min(numbers)
    entry = build_entry(trace, first_step=first, n_steps=max(numbers) - first + 1)
    rank, world = _rank_of(trace, index)
    steps = []
    for j, n in enumerate(numbers[: entry["n_steps"]]):
        row: dict[str, Any] = {"step": n, "time_s": entry["time_s"][j]}
        for part in PARTS:
            row[part] = entry[part][j]
        comm = row["comm_overlapped_s"] + row["comm_exposed_s"]
        row["overlap_ratio"] = row["comm_overlapped_s"] / comm if comm > 0 else None
        steps.append(row)
    colls = []
    for c in entry["collectives"]:
        sk = c["duration"]
        colls.append(
            {
                "op": c["op"],
                "count": c["count"],
                "bytes": c["bytes"],
                "total_s": sk["sum"],
                "p50_s": _quantile(sk, 0.5),
                "max_s": sk["max"],
            }
        )
    return RankReport(
        path=str(path),
        rank=rank,
        world_size=world,
        device=entry["device"],
        steps=steps,
        collectives=colls,
        before_window_s=w.before_window_us * 1e-6,
        entry=entry,
    )


def _lineup(ranks: Sequence[RankReport]) -> tuple[dict[int, dict[str, Any]], int]:
    given = tuple(sorted(r.rank for r in ranks))
    arrivals: dict[int, list[GroupArrivals]] = {}
    total = 0
    for r in ranks:
        t0 = float(r.entry["t0"])
        groups = []
        for g in r.entry["arrivals"]:
            total += len(g["step"])
            members = tuple(g["ranks"]) if g["ranks"] else given  # unlisted: the ranks given
            groups.append(
                GroupArrivals(
                    group=g["group"],
                    ranks=members,
                    size=len(members),
                    key_kind=g["key_kind"],
                    step=g["step"],
                    op=g["op"],
                    key=g["key"],
                    enter=[t0 + x for x in g["enter"]],
                    end=[t0 + x for x in g["end"]],
                )
            )
        arrivals[r.rank] = groups
    skew = split_wait_transfer(arrivals, world_size=len(given))
    out: dict[int, dict[str, Any]] = {}
    matched = 0
    for rank, s in skew.items():
        ops = {}
        n_rank = 0
        for op, (waits, transfers) in sorted(s.ops.items()):
            n_rank += len(waits)
            ops[op] = {
                "count": len(waits),
                "wait_s": math.fsum(waits),
                "transfer_s": math.fsum(transfers),
                "max_wait_s": max(waits),
            }
        matched += n_rank
        out[rank] = {
            "collectives": n_rank,
            "wait_s": math.fsum(v[0] for v in s.steps.values()),
            "transfer_s": math.fsum(v[1] for v in s.steps.values()),
            "ops": ops,
        }
    return out, total - matched


def analyse(paths: Iterable[str | Path]) -> Report:
    """Analyse trace files (one per rank; see the module docstring)."""
    files = find_traces(paths)
    ranks = [_rank_report(p, i) for i, p in enumerate(files)]
    seen: dict[int, str] = {}
    for r in ranks:
        if r.rank in seen:
            raise ValueError(f"{r.path} and {seen[r.rank]} are both rank {r.rank}: give one trace per rank")
        seen[r.rank] = r.path
    ranks.sort(key=lambda r: r.rank)
    lineup, unmatched = _lineup(ranks) if len(ranks) > 1 else ({}, 0)
    return Report(ranks=ranks, lineup=lineup, unmatched=unmatched)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.2f}"


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = "  ".join(
        h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(header, widths, strict=True))
    )
    out = [line]
    for r in rows:
        out.append(
            "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        )
    return out


def render(report: Report) -> str:
    """The report as plain-text tables (milliseconds)."""
    lines: list[str] = []
    for r in report.ranks:
        world = f" of {r.world_size}" if r.world_size else ""
        lines.append(f"rank {r.rank}{world}  ({r.device})  {r.path}")
        if r.before_window_s > 0:
            lines.append(
                f"  {_ms(r.before_window_s)} ms of device work launched before the trace started: in no step"
            )
        header = [
            "step",
            "time",
            "compute",
            "copy",
            "comm hidden",
            "comm exposed",
            "data wait",
            "idle",
            "overlap",
        ]
        rows = []
        for s in r.steps:
            ov = s["overlap_ratio"]
            rows.append(
                [
                    str(s["step"]),
                    _ms(s["time_s"]),
                    *(_ms(s[p]) for p in PARTS),
                    "-" if ov is None else f"{ov:.0%}",
                ]
            )
        lines.extend("  " + x for x in _table(header, rows))
        if r.collectives:
            rows = [
                [
                    c["op"],
                    str(c["count"]),
                    _size(c["bytes"]),
                    _ms(c["total_s"]),
                    _ms(c["p50_s"]),
                    _ms(c["max_s"]),
                ]
                for c in r.collectives
            ]
            lines.append("")
            lines.extend(
                "  " + x for x in _table(["collective", "count", "bytes", "total", "p50", "max"], rows)
            )
        lines.append("")
    if report.lineup:
        lines.append(
            f"collectives lined up across ranks {', '.join(str(r.rank) for r in report.ranks)} "
            "(wait: for the last rank to arrive; transfer: after it), ms"
        )
        rows = []
        for rank, v in sorted(report.lineup.items()):
            for op, o in v["ops"].items():
                rows.append(
                    [
                        str(rank),
                        op,
                        str(o["count"]),
                        _ms(o["wait_s"]),
                        _ms(o["max_wait_s"]),
                        _ms(o["transfer_s"]),
                    ]
                )
        lines.extend(
            "  " + x for x in _table(["rank", "collective", "count", "wait", "max wait", "transfer"], rows)
        )
        named = max((r.world_size or 0 for r in report.ranks), default=0)
        if named > len(report.ranks):
            lines.append(
                f"  the traces name a world of {named} ranks: collectives of groups they do not list "
                "the members of are lined up across the ranks given only"
            )
        if report.unmatched:
            lines.append(
                f"  {report.unmatched} collectives not lined up: some rank of their group is missing"
            )
    elif len(report.ranks) > 1:
        lines.append("no collective could be lined up across the ranks given")
    elif report.ranks:
        lines.append(
            "one rank given: pass every rank's trace to line the collectives up into wait and transfer"
        )
    return "\n".join(lines).rstrip() + "\n"


def main(paths: Sequence[str], *, as_json: bool) -> int:
    """The ``stepwatch trace`` command."""
    import sys

    try:
        report = analyse(paths)
    except (OSError, ValueError) as exc:
        print(f"stepwatch trace: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(json.dumps(report.to_dict(), indent=2) + "\n" if as_json else render(report))
    return 0
