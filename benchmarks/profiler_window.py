"""Amortised cost of the profiler window on a real 2-rank gloo training, paired runs.

Each pair runs the demo's tiny GPT on 2 gloo ranks twice, the agent on in both: once with
the profiler window at its default period and budget, once with it off
(``--profile-every 0``); the order alternates between pairs so that drift in machine
load hits both arms alike. Two figures, medians over pairs of the with/without ratio,
both over the training loop after warm-up as each rank measures it (mean of the ranks):

* wall time: what the job feels, but on a shared 2-core machine run-to-run noise is
  several percent, far above the 1% budget;
* CPU time of the rank processes (all threads: training, sender, profiler thread): the
  work the profiler adds, much less sensitive to other load on the machine.

The agents' self-measured figures (windows, period in force, cost per window, and the
amortised overhead they steer the period by) are printed next to them.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from stepwatch.demo import launch

PAIRS = 3
STEPS = 250
WARMUP = 10
BATCH = 4


def _once(col_url: str, tmp: Path, name: str, profile: bool) -> dict[str, Any]:
    out = tmp / f"{name}-rank{{rank}}.json"
    args = ["--run", name, "--steps", str(STEPS), "--batch", str(BATCH), "--warmup-steps", str(WARMUP)]
    args += ["--send-interval", "10", "--out", str(out)]
    if not profile:
        args += ["--profile-every", "0"]
    log_dir = tmp / name
    log_dir.mkdir()
    with launch.ranks(2, args, env={"STEPWATCH_URL": col_url}, log_dir=str(log_dir)) as procs:
        launch.wait_all(procs, timeout_s=300, log_dir=str(log_dir))
    ranks = [json.loads(Path(str(out).format(rank=r)).read_text()) for r in range(2)]
    loop = statistics.fmean(o["step_ends"][-1] - o["step_ends"][WARMUP - 1] for o in ranks)
    cpu = statistics.fmean(o["cpu_ends"][-1] - o["cpu_ends"][WARMUP - 1] for o in ranks)
    return {"loop_s": loop, "cpu_s": cpu, "profile": [o["stats"]["profile"] for o in ranks]}


def run() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="stepwatch-bench-") as d:
        tmp = Path(d)
        with launch.collector(f"sqlite:///{tmp / 'bench.db'}", log_path=str(tmp / "collector.log")) as col:
            pairs = []
            for p in range(PAIRS):
                order = (True, False) if p % 2 == 0 else (False, True)
                res = {on: _once(col.url, tmp, f"bench-{p}-{'on' if on else 'off'}", on) for on in order}
                pairs.append(res)
    ratios = [pr[True]["loop_s"] / pr[False]["loop_s"] for pr in pairs]
    cpu_ratios = [pr[True]["cpu_s"] / pr[False]["cpu_s"] for pr in pairs]
    stats = [s for pr in pairs for s in pr[True]["profile"] if s]
    costs = [s["last_cost"] for s in stats if s.get("last_cost")]
    return {
        "pairs": [
            (pr[True]["loop_s"], pr[False]["loop_s"], pr[True]["cpu_s"], pr[False]["cpu_s"]) for pr in pairs
        ],
        "median_ratio": statistics.median(ratios),
        "median_cpu_ratio": statistics.median(cpu_ratios),
        "windows_per_run": statistics.fmean(s["windows"] for s in stats) if stats else 0.0,
        "every": sorted({s["every"] for s in stats}),
        "cost_per_window_s": statistics.median(c["window_s"] for c in costs) if costs else None,
        "self_measured_ratio": statistics.median(c["overhead_ratio"] for c in costs if c["overhead_ratio"])
        if costs
        else None,
    }


def report(r: dict[str, Any]) -> list[str]:
    lines = [f"profiler window: 2 gloo ranks, {STEPS} steps (batch {BATCH}), {PAIRS} pairs, default period"]
    for on, off, con, coff in r["pairs"]:
        lines.append(
            f"  wall with {on:.2f} s / without {off:.2f} s = {on / off:.4f}; "
            f"cpu {con:.2f} s / {coff:.2f} s = {con / coff:.4f}"
        )
    for key, what in (("median_ratio", "wall"), ("median_cpu_ratio", "cpu")):
        lines.append(f"  median {what} ratio with/without: {r[key]:.4f} ({(r[key] - 1) * 100:+.2f}%)")
    cost = r["cost_per_window_s"]
    ratio = r["self_measured_ratio"]
    lines.append(
        f"  self-measured: {r['windows_per_run']:.1f} windows/run, period in force {r['every']} steps, "
        f"cost/window {cost * 1000:.1f} ms, amortised {ratio * 100:.2f}% (budget 1%)"
        if cost is not None and ratio is not None
        else "  self-measured: no window completed"
    )
    return lines
