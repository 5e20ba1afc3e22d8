"""``python -m benchmarks [NAME ...]`` (or ``make bench``): run every benchmark.

A benchmark is a public module of this package with a ``main()``; each prints its
figures as ratios against a baseline measured in the same run. With names, only those
run (``python -m benchmarks ingest query``).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path


def discover() -> list[str]:
    here = Path(__file__).parent
    names = []
    for info in pkgutil.iter_modules([str(here)]):
        if info.name.startswith("_"):
            continue
        if callable(getattr(importlib.import_module(f"benchmarks.{info.name}"), "main", None)):
            names.append(info.name)
    return sorted(names)


def main(argv: Sequence[str] | None = None) -> int:
    wanted = list(argv if argv is not None else sys.argv[1:]) or discover()
    failed = []
    for name in wanted:
        print(f"=== benchmarks.{name}", flush=True)
        t0 = time.perf_counter()
        module = importlib.import_module(f"benchmarks.{name}")
        saved, sys.argv = sys.argv, [f"benchmarks/{name}.py"]  # each runs with its defaults
        try:
            rc = module.main([]) if inspect.signature(module.main).parameters else module.main()
        except Exception:
            traceback.print_exc()
            rc = 1
        finally:
            sys.argv = saved
        print(f"=== benchmarks.{name}: {'ok' if rc == 0 else 'FAILED'} in {time.perf_counter() - t0:.0f} s\n")
        if rc:
            failed.append(name)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
