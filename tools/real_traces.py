"""Dev-only check of the trace parser on real multi-GPU traces you have on disk.

The traces are not in this repository (they belong to their projects): point this at a
folder of them, e.g. the ``tests/data`` folder of a checkout of
facebookresearch/HolisticTraceAnalysis, whose V100 / A100 DDP and DLRM traces are the
ones the parser was measured on. Every ``*.json`` / ``*.json.gz`` with GPU work and at
least three profiled steps is parsed; per trace it prints the device, the step times
(the first one apart), the device time of work launched before the window, the share of
device time classified as communication, the copies' share and the collectives by op.

Exit 1 when a trace's first step is more than 10% off the median of its other steps:
the GPU's tail from before the window must not land in the first step.

    .venv/bin/python tools/real_traces.py ~/src/HolisticTraceAnalysis/tests/data
"""

from __future__ import annotations

import statistics
import sys
from collections import Counter
from pathlib import Path

from stepwatch.profiler.breakdown import total, union
from stepwatch.profiler.chrome import load_chrome_trace
from stepwatch.profiler.trace import parse_chrome_trace, window_breakdown


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print(__doc__)
        return 2
    failed = 0
    for path in sorted(Path(argv[0]).rglob("*.json*")):
        if not path.name.endswith((".json", ".json.gz")):
            continue
        try:
            w = parse_chrome_trace(load_chrome_trace(path))
        except (OSError, ValueError) as exc:
            print(f"skip {path}: {exc}")
            continue
        if w.device != "cuda" or len(w.steps) < 3:
            continue
        times = [b.step_s * 1e3 for b in window_breakdown(w)]
        steady = statistics.median(times[1:])
        busy = total(union(w.compute, w.comm, w.copies))
        comm = total(w.comm) / busy if busy else 0.0
        copies = total(w.copies) / busy if busy else 0.0
        ops = Counter(r.op for r in w.collectives)
        off = abs(times[0] - steady) / steady if steady else 0.0
        verdict = "ok  " if off <= 0.10 else "FAIL"
        failed += verdict == "FAIL"
        print(
            f"{verdict} {path}: first step {times[0]:.1f} ms, steady {steady:.1f} ms ({off:.1%}); "
            f"before the window {w.before_window_us / 1e3:.1f} ms; communication {comm:.1%} of device "
            f"time, copies {copies:.1%}; {dict(sorted(ops.items()))}"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
