"""``python -m benchmarks`` (``make bench``): every benchmark, ratios against baselines
measured in the same run. ``python -m benchmarks hot_path`` runs one."""

from __future__ import annotations

import sys
import time

from . import hot_path, profiler_window

ALL = {"hot_path": hot_path, "profiler_window": profiler_window}


def main(argv: list[str]) -> int:
    names = argv or list(ALL)
    for name in names:
        mod = ALL[name]
        t0 = time.perf_counter()
        result = mod.run()
        for line in mod.report(result):
            print(line, flush=True)
        print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
