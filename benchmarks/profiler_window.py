"""Amortised cost of the profiler window on a real 2-rank gloo training, paired runs.

Each pair runs the demo's tiny GPT on 2 gloo ranks twice, the agent on in both: once with
the profiler window every :data:`PERIOD` steps under the default budget, once with it
off (``--profile-every 0``); the order alternates between pairs so that drift in machine
load hits both arms alike. Two figures, medians over pairs of the with/without ratio,
both over the training loop after warm-up as each rank measures it (mean of the ranks):

* wall time: what the job feels, but on a shared 2-core machine run-to-run noise is
  several percent, far above the 1% budget;
* CPU time of the rank processes (all threads: training, sender, profiler thread): the
  work the profiler adds, much less sensitive to other load on the machine.

Third, within each profiled run: the *in-run excess*. Around every window, the steps it
touched (its 2 steps and the 8 after, which carry the stop and the parse thread's
competition) are compared with the median of their neighbours (30 steps either side);
the excess, divided by the time of the window's period (period x that median step), is
the amortised cost at the period in force, measured from the ranks' own step times and
insensitive to slow drift of machine load. (At a period of 100 steps, this toy's ~30 ms
steps make a period only a few seconds, so the agent stretches it before the first
window: see ``stepwatch.profiler._window.PRIOR_COST_S``. The agent's default period,
2,000 steps, would give no window in a run this short: the window's cost per window is
what is measured, and the budget sets the period it is amortised over.)

The agents' self-measured figures (windows, period in force, cost per window, and the
amortised overhead they steer the period by, at the period the window ran under and at
the period in force after it) are printed next to them, and the self-estimate at the
period each window ran under is checked against the in-run excess over the same periods:
the agent steers its period by the former, so it must agree with the latter within a
factor of AGREE (met/missed).
"""

from __future__ import annotations

import itertools
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from stepwatch.config import AgentConfig
from stepwatch.demo import launch
from stepwatch.profiler._window import PRIOR_COST_S, stretch

PAIRS = 3
#: The profiled arm's period before the budget's stretch (the agent's default of 2,000
#: steps would not fire in :data:`STEPS`).
PERIOD = 100
#: Steps of each run at least; more where the period in force needs them (:func:`steps_for`).
STEPS = 450
#: Steps of the run that measures the step time, before the pairs.
CALIBRATION_STEPS = 80
WARMUP = 10
BATCH = 2


AFTER = 8
NEIGHBOURS = 30
AGREE = 2.0


def steps_for(step_s: float, budget: float = AgentConfig.profile_budget) -> tuple[int, int]:
    """(period in force at the first window, steps per run) for steps of ``step_s``.

    Before its first window the agent stretches :data:`PERIOD` by its own rule
    (:func:`stepwatch.profiler._window.stretch`) until its prior cost
    (:data:`PRIOR_COST_S`) is within ``budget`` of a period; the run must hold that first
    window, its steps and the neighbours the in-run excess compares them with. Sized for
    steps a fifth faster than measured (the agent reads its own median), so a run on a
    fast machine still holds a window instead of reporting none: with 450 steps fixed,
    20 ms steps stretched the period to 800 and no window fired.
    """
    every = PERIOD * stretch(PERIOD, PRIOR_COST_S, budget, 0.8 * step_s)
    return every, max(STEPS, every + 2 + AFTER + NEIGHBOURS + 10)


def _in_run_excess(o: dict[str, Any], k: int = 2) -> tuple[float, float]:
    """(excess seconds over all windows, what those windows' periods took) for one rank:
    their ratio is the amortised cost at the periods in force."""
    ends = [o["start"], *o["step_ends"]]
    d = [b - a for a, b in itertools.pairwise(ends)]  # d[i] is step i + 1
    windows = o["stats"]["profile"]["recent_windows"] if o["stats"]["profile"] else []
    touched: set[int] = set()
    for f, _ in windows:
        touched.update(range(f - 1, min(len(d), f - 1 + k + AFTER)))
    excess = period = 0.0
    for f, every in windows:
        span = list(range(f - 1, min(len(d), f - 1 + k + AFTER)))
        lo, hi = max(WARMUP, f - 1 - NEIGHBOURS), min(len(d), f - 1 + k + AFTER + NEIGHBOURS)
        near = [d[i] for i in range(lo, hi) if i not in touched]
        if near:
            base = statistics.median(near)
            excess += sum(d[i] for i in span) - len(span) * base
            period += every * base
    return excess, period


def _once(col_url: str, tmp: Path, name: str, profile: bool, steps: int) -> dict[str, Any]:
    out = tmp / f"{name}-rank{{rank}}.json"
    args = ["--run", name, "--steps", str(steps), "--batch", str(BATCH), "--warmup-steps", str(WARMUP)]
    args += ["--send-interval", "10", "--out", str(out)]
    args += ["--profile-every", str(PERIOD if profile else 0)]
    log_dir = tmp / name
    log_dir.mkdir()
    with launch.ranks(2, args, env={"STEPWATCH_URL": col_url}, log_dir=str(log_dir)) as procs:
        launch.wait_all(procs, timeout_s=300, log_dir=str(log_dir))
    ranks = [json.loads(Path(str(out).format(rank=r)).read_text()) for r in range(2)]
    loop = statistics.fmean(o["step_ends"][-1] - o["step_ends"][WARMUP - 1] for o in ranks)
    cpu = statistics.fmean(o["cpu_ends"][-1] - o["cpu_ends"][WARMUP - 1] for o in ranks)
    excess = [_in_run_excess(o) for o in ranks] if profile else []
    return {
        "loop_s": loop,
        "cpu_s": cpu,
        "profile": [o["stats"]["profile"] for o in ranks],
        "excess": excess,
    }


def run() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="stepwatch-bench-") as d:
        tmp = Path(d)
        with launch.collector(f"sqlite:///{tmp / 'bench.db'}", log_path=str(tmp / "collector.log")) as col:
            calibration = _once(col.url, tmp, "bench-calibration", False, CALIBRATION_STEPS)
            step_s = calibration["loop_s"] / (CALIBRATION_STEPS - WARMUP)
            every, steps = steps_for(step_s)
            pairs = []
            for p in range(PAIRS):
                order = (True, False) if p % 2 == 0 else (False, True)
                res = {
                    on: _once(col.url, tmp, f"bench-{p}-{'on' if on else 'off'}", on, steps) for on in order
                }
                pairs.append(res)
    ratios = [pr[True]["loop_s"] / pr[False]["loop_s"] for pr in pairs]
    cpu_ratios = [pr[True]["cpu_s"] / pr[False]["cpu_s"] for pr in pairs]
    stats = [s for pr in pairs for s in pr[True]["profile"] if s]
    costs = [s["last_cost"] for s in stats if s.get("last_cost")]
    excess = [e for pr in pairs for e in pr[True]["excess"]]
    return {
        "steps": steps,
        "calibrated_step_s": step_s,
        "expected_every": every,
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
        "self_measured_ratio_in_force": statistics.median(
            c["overhead_ratio"] * c["every"] / c["next_every"] for c in costs if c["overhead_ratio"]
        )
        if costs
        else None,
        "in_run_excess_ratio": sum(e for e, _ in excess) / sum(t for _, t in excess)
        if sum(t for _, t in excess) > 0
        else None,
    }


def report(r: dict[str, Any]) -> list[str]:
    lines = [
        f"profiler window: 2 gloo ranks, {r.get('steps', STEPS)} steps (batch {BATCH}), {PAIRS} pairs, "
        f"period {PERIOD} and the default budget"
        + (
            f" (steps of {r['calibrated_step_s'] * 1e3:.1f} ms measured first: the period is stretched "
            f"to about {r['expected_every']} before the first window, and each run holds one)"
            if "calibrated_step_s" in r
            else ""
        )
    ]
    for on, off, con, coff in r["pairs"]:
        lines.append(
            f"  wall with {on:.2f} s / without {off:.2f} s = {on / off:.4f}; "
            f"cpu {con:.2f} s / {coff:.2f} s = {con / coff:.4f}"
        )
    for key, what in (("median_ratio", "wall"), ("median_cpu_ratio", "cpu")):
        lines.append(f"  median {what} ratio with/without: {r[key]:.4f} ({(r[key] - 1) * 100:+.2f}%)")
    if r["in_run_excess_ratio"] is not None:
        lines.append(
            "  in-run excess of the touched steps over their neighbours, per period in force: "
            f"{r['in_run_excess_ratio'] * 100:.2f}%"
        )
    cost = r["cost_per_window_s"]
    ratio, now = r["self_measured_ratio"], r["self_measured_ratio_in_force"]
    lines.append(
        f"  self-measured: {r['windows_per_run']:.1f} windows/run, period in force {r['every']} steps, "
        f"cost/window {cost * 1000:.1f} ms, amortised {ratio * 100:.2f}% at the period it ran under, "
        f"{now * 100:.2f}% at the period in force (budget 1%)"
        if cost is not None and ratio is not None and now is not None
        else "  self-measured: no window completed"
    )
    inrun, own = r["in_run_excess_ratio"], r["self_measured_ratio"]
    if inrun is not None and own is not None and inrun > 0 and own > 0:
        factor = max(own / inrun, inrun / own)
        lines.append(
            f"  self-estimate against the in-run excess (same periods): {own:.2%} vs {inrun:.2%}, "
            f"{'under' if own < inrun else 'over'} by {factor:.1f}x; budget (within {AGREE:.0f}x): "
            f"{'met' if factor <= AGREE else 'MISSED'}"
        )
    else:
        lines.append(
            "  self-estimate against the in-run excess: not comparable (no window or no excess): MISSED"
        )
    return lines
