"""Rich renderables for a run, built only from API answers (plain dicts).

Shared by ``stepwatch top`` and the live view of ``stepwatch demo``. Optional parts of
the API (the time breakdown of the profiler window, events, progress) are shown when the
collector serves them; when it does not, the view says what is missing instead of
showing zeros.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from rich.console import Group, RenderableType
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from .client import JSON, Snapshot

#: Parts of a step, in the order they are stacked (DESIGN §3); they sum to the step time.
BREAKDOWN: tuple[tuple[str, str, str], ...] = (
    ("compute_s", "compute", "green"),
    ("comm_overlapped_s", "comm overlapped", "cyan"),
    ("comm_exposed_s", "comm exposed", "red"),
    ("data_wait_s", "data wait", "yellow"),
    ("idle_s", "idle", "bright_black"),
)
#: Per-rank columns compared with the peer median (the straggler's tell-tales).
#: Per-rank columns, seconds per step (the table's title says so, so that every header
#: fits on one line of an 80-column terminal).
RANK_COLUMNS: tuple[tuple[str, str], ...] = (
    ("step_time_s", "step"),
    ("compute_s", "compute"),
    ("comm_wait_s", "comm wait"),
    ("data_wait_s", "data wait"),
)
OUTLIER_RATIO = 1.10
SPARK = "▁▂▃▄▅▆▇█"


def num(v: Any, spec: str = ".3g") -> str:
    return "–" if v is None else format(v, spec)


def pct(v: Any) -> str:
    return "–" if v is None else f"{100 * v:.2f}%"


def ago(ts: float | str | None, now: float | None = None) -> str:
    """``ts``: ISO-8601 (this collector) or epoch seconds (collectors before run status)."""
    if not ts:
        return "never"
    if isinstance(ts, str):
        try:
            ts = datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return str(ts)
    s = max(0.0, (now or time.time()) - ts)
    if s < 90:
        return f"{s:.0f} s ago"
    if s < 5400:
        return f"{s / 60:.0f} min ago"
    return f"{s / 3600:.1f} h ago"


def duration(s: float | None) -> str:
    if s is None:
        return "–"
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    if s < 172_800:
        return f"{s / 3600:.1f} h"
    return f"{s / 86_400:.1f} days"


def sparkline(values: Sequence[float | None]) -> str:
    """Unicode bars scaled between the series' min and max (flat series: lowest bar)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    span = hi - lo
    out = []
    for v in values:
        if v is None:
            out.append(" ")
        else:
            out.append(SPARK[int((v - lo) / span * (len(SPARK) - 1)) if span > 0 else 0])
    return "".join(out)


def breakdown_of(rank: Mapping[str, Any]) -> dict[str, float] | None:
    """A rank's time breakdown from its newest profiler window (``profile`` in
    ``/ranks``), or a nested ``breakdown`` object, or top-level fields; ``None`` while no
    profiler window has reported for it."""
    src = rank.get("profile") or rank.get("breakdown")
    if not isinstance(src, Mapping):
        src = rank
    if src.get("compute_s") is None:
        return None
    parts = {key: float(src.get(key) or 0.0) for key, _, _ in BREAKDOWN}
    if src.get("data_wait_s") is None and rank.get("data_wait_s") is not None:
        parts["data_wait_s"] = float(rank["data_wait_s"])
    return parts


def job_breakdown(ranks: Iterable[Mapping[str, Any]]) -> dict[str, float] | None:
    """Mean breakdown over the ranks that have one."""
    found = [b for b in (breakdown_of(r) for r in ranks) if b is not None]
    if not found:
        return None
    return {key: statistics.fmean(b[key] for b in found) for key, _, _ in BREAKDOWN}


def _value(rank: Mapping[str, Any], key: str) -> float | None:
    bd = rank.get("profile") or rank.get("breakdown")
    v = bd.get(key) if isinstance(bd, Mapping) and key in bd else rank.get(key)
    return None if v is None else float(v)


def breakdown_bar(parts: Mapping[str, float] | None, width: int = 48) -> RenderableType:
    if parts is None:
        return Text(
            "time breakdown: no profiler data yet (it appears once a profiler window has reported)",
            style="dim",
        )
    total = sum(parts.values())
    if total <= 0:
        return Text("time breakdown: empty", style="dim")
    bar, legend = Text(), Text()
    for key, label, color in BREAKDOWN:
        share = parts.get(key, 0.0) / total
        bar.append("█" * round(share * width), style=color)
        legend.append(f" {label} {share:.0%}", style=color)
    return Group(Text.assemble("time breakdown ", bar), legend)


def _open_flags(events: Sequence[JSON]) -> dict[int, str]:
    flags: dict[int, str] = {}
    for e in events:
        if e.get("status") != "open":
            continue
        label = e.get("kind", "event") + (f" ({e['cause']})" if e.get("cause") else "")
        for r in e.get("ranks") or []:
            flags[int(r)] = label
    return flags


def ranks_table(ranks: Sequence[JSON], events: Sequence[JSON] = (), max_rows: int = 16) -> Table:
    """Per-rank latest window. Cells at least 10% above (red) or below (cyan) the median
    of all ranks stand out; ranks named by an open event are marked."""
    flags = _open_flags(events)
    cols = [(k, label) for k, label in RANK_COLUMNS if any(_value(r, k) is not None for r in ranks)]
    medians = {}
    for key, _ in cols:
        vals = [v for v in (_value(r, key) for r in ranks) if v is not None]
        medians[key] = statistics.median(vals) if len(vals) >= 3 else None
    shown = list(ranks)
    if len(shown) > max_rows:  # the flagged and the slowest first: a table of 4,096 rows helps nobody
        shown.sort(key=lambda r: (r["rank"] not in flags, -(_value(r, "step_time_s") or 0.0)))
        shown = sorted(shown[:max_rows], key=lambda r: int(r["rank"]))
    hidden = len(ranks) - len(shown)
    title = "ranks (latest window, s per step)" + (f", {hidden} more not shown" if hidden else "")
    # No box and one space each side of a cell: the table fits 80 columns; a flagged
    # rank is marked in its own cell (the events table below says what the flag is).
    table = Table(title=title, title_justify="left", expand=False, box=None, padding=(0, 1), pad_edge=False)
    table.add_column("rank", justify="right", no_wrap=True)
    table.add_column("host", no_wrap=True, overflow="ellipsis", max_width=12)
    table.add_column("last step", justify="right", no_wrap=True)
    for _, label in cols:
        table.add_column(label, justify="right", no_wrap=True)
    table.add_column("tokens/s", justify="right", no_wrap=True)
    for r in shown:
        rank_cell = Text(f"⚠ {r['rank']}", style="bold red") if r["rank"] in flags else Text(str(r["rank"]))
        cells: list[Text | str] = [rank_cell, str(r.get("host", "")), str(r.get("last_step", ""))]
        for key, _ in cols:
            v, med = _value(r, key), medians[key]
            style = ""
            if v is not None and med:
                if v >= med * OUTLIER_RATIO:
                    style = "bold red"
                elif v <= med / OUTLIER_RATIO:
                    style = "cyan"
            cells.append(Text(num(v), style=style))
        cells.append(num(r.get("tokens_per_s"), ",.0f"))
        table.add_row(*cells)
    return table


#: What an event's status means, said once above the events (a demo's own fault
#: injection ending is not the collector clearing its flag).
EVENTS_LEGEND = "open: flagged now · closed: flagged, then cleared"


def events_view(events: Sequence[JSON], max_rows: int = 8, *, compact: bool = False) -> RenderableType:
    """One line per event (status, what, ranks, steps, cost), its message on the full
    width below it: a message column beside five others was ~17 characters wide at 80
    columns, and one message took 24 lines. ``compact`` (the live view, which must fit
    a 24-line terminal) crops each message to one line."""
    if not events:
        return Text(
            "events: none (stragglers, regressions and hangs are listed here when flagged)", style="dim"
        )
    lines: list[RenderableType] = [Text.assemble(("events", "bold"), ("  " + EVENTS_LEGEND, "dim"))]
    shown = list(events)[:max_rows]
    for e in shown:
        is_open = e.get("status") == "open"
        what = e.get("kind", "") + (f"/{e['cause']}" if e.get("cause") else "")
        ranks = ",".join(str(r) for r in e.get("ranks") or [])
        cost = f"cost {num(e.get('cost_seconds'))} s/step ({pct(e.get('cost_ratio'))})"
        head = Text.assemble(
            (f"{e.get('status', '')}", "bold red" if is_open else "green"),
            f"  {what}",
            f"  rank{'s' if ',' in ranks else ''} {ranks}" if ranks else "",
            f"  steps {e.get('first_step')}–{e.get('last_step')}",
            f"  {pct(e.get('cost_ratio'))}" if compact else f"  {cost}",
        )
        message = str(e.get("message", ""))
        if compact:  # one line: the numbers, then as much of the message as fits
            head.append("  " + message, style="dim")
            head.no_wrap, head.overflow = True, "ellipsis"
            lines.append(head)
        else:
            lines += [head, Padding(Text(message, style="dim"), (0, 0, 0, 2))]
    if len(events) > len(shown):
        lines.append(
            Text(f"  ... {len(events) - len(shown)} more (the web page lists them all)", style="dim")
        )
    return Group(*lines)


def progress_view(overview: Mapping[str, Any]) -> RenderableType | None:
    p = overview.get("progress")
    if not isinstance(p, Mapping):
        return None
    done = p.get("fraction_done")
    text = Text("progress ")
    if done is not None:
        filled = round(float(done) * 30)
        text.append("█" * filled, style="green").append("░" * (30 - filled), style="dim")
        text.append(f" {float(done):.1%}")
    elif p.get("tokens_done") is not None:  # no target: say what is known and how to get the rest
        text.append(f"{float(p['tokens_done']):,.0f} tokens done")
        text.append("  no target (target_tokens= gives % done and ETA)", style="dim")
    eta = p.get("eta_s")
    if eta is not None:
        text.append(f"  ETA {duration(float(eta))}")
    if p.get("required_step_time_s") is not None:
        text.append(f"  needs ≤ {num(p['required_step_time_s'])} s/step for the deadline")
    if p.get("on_track") is False:
        text.append("  behind plan", style="bold red")
    return text if text.plain.strip() != "progress" else None  # never a bare "progress"


def headline(overview: Mapping[str, Any]) -> Table:
    table = Table(show_header=True, box=None, pad_edge=False)
    table.add_column("")
    table.add_column("latest", justify="right")
    table.add_column("mean", justify="right")
    rows = (
        ("MFU", "mfu", pct),
        ("tokens/s", "tokens_per_s", lambda v: num(v, ",.0f")),
        ("step time (s)", "step_time_s", num),
        ("data wait (s/step)", "data_wait_s", num),
    )
    for label, key, f in rows:
        stat = overview.get(key) or {}
        why = overview.get("mfu_unavailable") if key == "mfu" else None
        if why:  # say what to pass instead of two dashes
            table.add_row(label, Text(str(why), style="yellow"), "")
        else:
            table.add_row(label, f(stat.get("latest")), f(stat.get("mean")))
    return table


_DTYPE_HOW = {
    "given": "as given",
    "autocast": "from autocast",
    "parameters": "from the parameters",
    "default": "assumed, pass dtype=",
}


def dtype_note(conv: JSON) -> str:
    """How the dtype MFU is measured at was chosen (``stepwatch._dtype``), or "" when the
    convention predates the field."""
    how = _DTYPE_HOW.get(str(conv.get("dtype_source")))
    return f" (dtype {conv.get('dtype')} {how})" if how else ""


def run_view(snap: Snapshot, *, max_rows: int = 16, compact: bool = False) -> Group:
    """Everything about one run, top to bottom: numbers, step-time trend, breakdown,
    ranks, events (the step-time trend: its newest 36 points, one line at 80 columns).
    ``compact``: events one line each and at most 2 of them, so that a live view of a
    few ranks fits an 80x24 terminal (rich's Live crops what does not fit, and the events
    are at the bottom)."""
    ov = snap.overview
    conv = ov.get("convention") or {}
    title = Text.assemble(
        ("run ", "dim"),
        (str(ov.get("name")), "bold"),
        *status_badge(ov.get("status")),
        f"  {ov.get('ranks_reporting')}/{ov.get('world_size')} ranks  step {ov.get('last_step') or 0}",
        ("  MFU formula: " + str(conv.get("id") or conv.get("formula") or "none (no peak FLOP/s)"), "dim"),
        (dtype_note(conv), "dim"),
    )
    parts: list[RenderableType] = [title, headline(ov)]
    progress = progress_view(ov)
    if progress is not None:
        parts.append(progress)
    step_times = snap.step_times[-36:]  # one line at 80 columns
    if step_times:
        means = [p.get("mean") for p in step_times]
        first, last = step_times[0]["step_from"], step_times[-1]["step_to"]
        parts.append(
            Text.assemble(
                ("step time ", ""),
                (sparkline(means), "magenta"),
                (f"  steps {first}–{last}, {num(min(m for m in means if m is not None))}", "dim"),
                (f"–{num(max(m for m in means if m is not None))} s", "dim"),
            )
        )
    parts.append(breakdown_bar(job_breakdown(snap.ranks)))
    parts.append(ranks_table(snap.ranks, snap.events, max_rows=max_rows))
    parts.append(events_view(snap.events, max_rows=2, compact=True) if compact else events_view(snap.events))
    return Group(*parts)


#: Colour of each run status (the collector's ``reads/status.py`` defines them).
STATUS_STYLE = {"live": "bold green", "finished": "dim", "stalled": "bold yellow", "hung": "bold red"}


def status_badge(status: object) -> tuple[tuple[str, str], ...]:
    """`` [status]`` coloured, or nothing from a collector that predates run status."""
    if not status:
        return ()
    return (("  [", "dim"), (str(status), STATUS_STYLE.get(str(status), "")), ("]", "dim"))


def runs_table(runs: Sequence[JSON], selected: str | None = None) -> Table:
    table = Table(title="runs", title_justify="left")
    for col in ("run", "status", "ranks", "last step", "last seen"):
        table.add_column(col, justify="left" if col == "run" else "right")
    now = time.time()
    for r in runs:
        name = Text(r["name"], style="bold" if r["name"] == selected else "")
        status = str(r.get("status") or "–")
        table.add_row(
            name,
            Text(status, style=STATUS_STYLE.get(status, "")),
            f"{r.get('ranks_reporting')}/{r.get('world_size')}",
            str(r.get("last_step") if r.get("last_step") is not None else "–"),
            ago(r.get("last_seen"), now),
        )
    return table
