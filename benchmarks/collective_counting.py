"""The collective-counting wrappers' cost per call (``sw.watch_collectives()``): a real
gloo ``all_reduce`` of a small tensor (the cheapest collective, so the worst ratio) and a
``barrier``, wrapped against unwrapped, sync and ``async_op=True``.

    python -m benchmarks.collective_counting [--rounds 8] [--calls 2000] [--numel 256]

One process, a one-rank gloo group (the per-call Python work is what the wrapper adds;
with more ranks the collective itself only gets longer, so the ratio only falls). A round
times ``--calls`` calls of each configuration in a rotated order: ``plain``,
``plain, again`` (the A/A noise band) and ``counted``; the figure is the median over
rounds of each configuration's time per call divided by ``plain``'s of the same round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

CONFIGS = ("plain", "plain, again", "counted")


def _time(fn: Callable[[], Any], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def run(rounds: int = 8, calls: int = 2000, numel: int = 256) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from stepwatch import _collectives
    from stepwatch._comm_timing import CommTiming

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{Path(tmp) / 'store'}", rank=0, world_size=1)
        try:
            plain_ar, plain_bar = dist.all_reduce, dist.barrier
            timing = CommTiming(16, lambda: (1, 0))
            _collectives.install(timing)
            counted_ar, counted_bar = dist.all_reduce, dist.barrier
            x = torch.ones(numel)
            cases: dict[str, dict[str, Callable[[], Any]]] = {
                "all_reduce": {
                    "plain": lambda: plain_ar(x),
                    "counted": lambda: counted_ar(x),
                },
                "all_reduce async": {
                    "plain": lambda: plain_ar(x, async_op=True).wait(),
                    "counted": lambda: counted_ar(x, async_op=True).wait(),
                },
                "barrier": {"plain": lambda: plain_bar(), "counted": lambda: counted_bar()},
            }
            out: dict[str, Any] = {"rounds": rounds, "calls": calls, "numel": numel, "cases": {}}
            for case, fns in cases.items():
                fns["plain, again"] = fns["plain"]
                for name in CONFIGS:  # warm-up
                    _time(fns[name], calls // 10 or 1)
                per: dict[str, list[float]] = {c: [] for c in CONFIGS}
                for rnd in range(rounds):
                    order = CONFIGS[rnd % 3 :] + CONFIGS[: rnd % 3]
                    for name in order:
                        per[name].append(_time(fns[name], calls))
                ratios = {
                    c: statistics.median(a / b for a, b in zip(per[c], per["plain"], strict=True))
                    for c in CONFIGS[1:]
                }
                plain_s = statistics.median(per["plain"])
                out["cases"][case] = {
                    "plain_s": plain_s,
                    "aa_ratio": ratios["plain, again"],
                    "ratio": ratios["counted"],
                    "added_s": statistics.median(per["counted"]) - plain_s,
                }
            world = timing.seq["world"]
            out["counted"] = world.entered
            out["completed"] = world.completed
        finally:
            _collectives.uninstall()
            dist.destroy_process_group()
    return out


def report(f: dict[str, Any]) -> list[str]:
    lines = [
        f"collective counting: one-rank gloo, {f['numel']} floats, {f['calls']} calls x "
        f"{f['rounds']} rounds (median of paired ratios); {f['counted']} counted, {f['completed']} completed"
    ]
    for case, c in f["cases"].items():
        lines.append(
            f"  {case:<17} plain {c['plain_s'] * 1e6:7.2f} us  counted/plain {c['ratio']:.4f} "
            f"({c['added_s'] * 1e6:+.2f} us)  A/A {c['aa_ratio']:.4f}"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--numel", type=int, default=256)
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for line in report(run(args.rounds, args.calls, args.numel)):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
