"""``stepwatch demo``: collector + a real multi-rank CPU training, then a summary read
back from the collector's API (what a user would see)."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any

import httpx

from . import launch


def measure_cpu_peak_flops(n: int = 256, repeats: int = 30) -> float:
    """Best observed single-thread fp32 matmul rate on this CPU.

    CPUs have no datasheet row in stepwatch's peak table, so the demo *declares* a peak
    it measured (and says so in the convention); it is an upper bound in practice, not
    the vendor's theoretical number.
    """
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(n, n), torch.randn(n, n)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


def _fmt(v: Any, spec: str = ".3g") -> str:
    return "-" if v is None else format(v, spec)


def print_summary(url: str, run: str) -> dict[str, Any]:
    from rich.console import Console
    from rich.table import Table

    with httpx.Client(base_url=url, timeout=10.0) as c:
        ov = c.get(f"/api/v1/runs/{run}").raise_for_status().json()
        ranks = c.get(f"/api/v1/runs/{run}/ranks").raise_for_status().json()
    console = Console()
    conv = ov["convention"] or {}
    job = Table(title=f"run {run}: {ov['ranks_reporting']}/{ov['world_size']} ranks, steps {ov['last_step']}")
    job.add_column("metric")
    job.add_column("latest", justify="right")
    job.add_column("mean (after warm-up)", justify="right")
    job.add_row("step time (s)", _fmt(ov["step_time_s"]["latest"]), _fmt(ov["step_time_s"]["mean"]))
    job.add_row(
        "tokens/s", _fmt(ov["tokens_per_s"]["latest"], ",.0f"), _fmt(ov["tokens_per_s"]["mean"], ",.0f")
    )
    job.add_row("MFU", _fmt(ov["mfu"]["latest"], ".2%"), _fmt(ov["mfu"]["mean"], ".2%"))
    job.add_row("data wait (s/step)", _fmt(ov["data_wait_s"]["latest"]), _fmt(ov["data_wait_s"]["mean"]))
    console.print(job)
    console.print(f"MFU convention: [bold]{conv.get('id', conv.get('formula', 'none'))}[/bold]")
    console.print(f"padding ratio: {_fmt(ov['padding_ratio'], '.1%')}, tokens total: {ov['tokens_total']:,}")
    per_rank = Table(title="ranks (latest window)")
    for col in (
        "rank",
        "host",
        "last step",
        "step time (s)",
        "max (s)",
        "data wait (s)",
        "tokens/s",
        "dropped",
    ):
        per_rank.add_column(col, justify="right")
    for r in ranks:
        per_rank.add_row(
            str(r["rank"]),
            r["host"],
            str(r["last_step"]),
            _fmt(r["step_time_s"]),
            _fmt(r["step_time_max_s"]),
            _fmt(r["data_wait_s"]),
            _fmt(r["tokens_per_s"], ",.0f"),
            str(r["dropped_windows"]),
        )
    console.print(per_rank)
    return {"overview": ov, "ranks": ranks}


def run_demo(ranks: int = 4, steps: int = 60, keep: bool = False) -> int:
    from rich.console import Console

    console = Console()
    t0 = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="stepwatch-demo-")
    db_path = os.path.abspath("stepwatch-demo.db") if keep else os.path.join(workdir, "demo.db")
    run = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        peak = measure_cpu_peak_flops()
        console.print(
            f"[dim]measured CPU peak (1 thread, fp32 matmul): {peak / 1e9:.1f} GFLOP/s per rank[/dim]"
        )
        with launch.collector(f"sqlite:///{db_path}", log_path=os.path.join(workdir, "collector.log")) as col:
            console.print(f"collector on {col.url} (SQLite {db_path})")
            console.print(
                f"training {ranks} gloo ranks x {steps} steps of a tiny GPT, run [bold]{run}[/bold] ..."
            )
            args = ["--run", run, "--steps", str(steps), "--peak-flops", str(peak), "--send-interval", "2"]
            env = {"STEPWATCH_URL": col.url}
            with launch.ranks(ranks, args, env=env, log_dir=workdir) as procs:
                launch.wait_all(procs, timeout_s=600, log_dir=workdir)
            print_summary(col.url, run)
        console.print(f"[green]demo finished in {time.monotonic() - t0:.1f} s[/green]")
        if keep:
            console.print(f"data kept in {db_path}: stepwatch serve --database-url sqlite:///{db_path}")
        return 0
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; all demo processes stopped[/yellow]")
        return 130
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
