"""``stepwatch evaluate``: run the scenarios on both paths, print the table, check the goals.

Default: every fault scenario once through a real collector process (simulator -> HTTP ->
storage -> analysis worker -> events), plus clean runs there; then every fault scenario
over five seeds and long clean runs straight into the detectors. About a minute and a
half on two cores. ``--fast``: fewer and shorter scenarios and no real-time hang
scenarios (the test suite runs it).

Exit status 0 when every goal is met (each fault flagged with the right cause and rank
within its goal, no false flag), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from .paths import Outcome, collector, run_collector, run_direct
from .scenarios import (
    MFU_GOAL_WINDOWS,
    REGRESSION_GOAL_WINDOWS,
    STRAGGLER_GOAL_WINDOWS,
    clean_scenarios,
    direct_clean_scenarios,
    fault_scenarios,
    realtime_scenarios,
)
from .score import Row, rows


def _fmt_delay(r: Row) -> str:
    if not r.delays:
        return "-"
    lo, hi = min(r.delays), max(r.delays)
    if r.unit == "s":
        return f"{lo:.1f} s" if lo == hi else f"{lo:.1f}-{hi:.1f} s"
    return f"{lo:.0f}" if lo == hi else f"{lo:.0f}-{hi:.0f}"


def render(table_rows: Sequence[Row], title: str) -> Any:
    from rich.table import Table

    t = Table(title=title)
    for col, just in (
        ("scenario", "left"),
        ("path", "left"),
        ("runs", "right"),
        ("flagged", "right"),
        ("cause+rank", "right"),
        ("to flag", "right"),
        ("false flags", "right"),
        ("clean windows (rank / job)", "right"),
        ("goal", "left"),
    ):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    for r in table_rows:
        ok = r.goal == r.runs
        t.add_row(
            r.scenario,
            r.path,
            str(r.runs),
            "-" if r.clean else f"{r.flagged}/{r.runs}",
            "-" if r.clean else f"{r.right}/{r.runs}",
            _fmt_delay(r) + ("" if r.clean or not r.delays else f" {r.unit}" if r.unit == "windows" else ""),
            str(r.false_flags),
            f"{r.rank_windows:,} / {r.job_windows:,}" if r.clean else "",
            "[green]met[/green]" if ok else "[red]MISSED[/red]",
        )
    return t


def evaluate(*, fast: bool, database_url: str | None, seed: int, progress: Any = None) -> list[Outcome]:
    """Run every scenario (see the module docstring); return the outcomes."""
    outcomes: list[Outcome] = []
    seeds = [seed] if fast else [seed + i for i in range(5)]
    # Hangs need real seconds to pass; --fast leaves them to the full run (and the tests).
    collector_runs = (
        fault_scenarios(fast=fast) + ([] if fast else realtime_scenarios()) + clean_scenarios(fast=fast)
    )
    direct_runs = [(s, k) for s in fault_scenarios(fast=fast) for k in seeds]
    direct_runs += [(s, seed) for s in direct_clean_scenarios(fast=fast)]
    task = progress.add_task("scenarios", total=len(collector_runs) + len(direct_runs)) if progress else None
    with collector(database_url) as url:
        for s in collector_runs:
            outcomes.append(run_collector(s, seed, url))
            if progress is not None:
                progress.advance(task)
    for s, k in direct_runs:
        outcomes.append(run_direct(s, k))
        if progress is not None:
            progress.advance(task)
    return outcomes


def main(args: argparse.Namespace) -> int:
    if args.real:
        from . import real

        argv = ["--runs", str(args.runs)]
        argv += [x for name in args.scenario or [] for x in ("--scenario", name)]
        if args.json:
            argv += ["--json", args.json]
        return real.main(argv)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(width=max(160, Console().width))
    t0 = time.monotonic()
    with Progress(
        TextColumn("evaluating"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        outcomes = evaluate(fast=args.fast, database_url=args.database_url, seed=args.seed, progress=progress)
    table_rows = rows(outcomes)
    console.print(render(table_rows, "stepwatch detector evaluation"))
    clean = [r for r in table_rows if r.clean]
    rank_w = sum(r.rank_windows for r in clean)
    job_w = sum(r.job_windows for r in clean)
    false_clean = sum(r.false_flags for r in clean)
    met = all(r.goal == r.runs for r in table_rows)
    console.print(
        f"goals: stragglers flagged with the right cause and rank within {STRAGGLER_GOAL_WINDOWS} windows, "
        f"a 5% MFU drop within {MFU_GOAL_WINDOWS} windows, a job-wide +10% within "
        f"{REGRESSION_GOAL_WINDOWS}, hangs within their threshold; "
        f"{false_clean} false flags over {rank_w:,} clean rank-windows ({job_w:,} job windows). "
        + ("[green]All met.[/green]" if met else "[red]Some missed.[/red]")
    )
    console.print(f"[dim]{time.monotonic() - t0:.0f} s[/dim]")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"met": met, "rows": [asdict(r) for r in table_rows]}, f, indent=1)
    return 0 if met else 1
