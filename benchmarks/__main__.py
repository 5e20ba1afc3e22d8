"""``python -m benchmarks [NAME ...]`` (``make bench``): every benchmark, ratios against
baselines measured in the same run. ``python -m benchmarks hot_path ingest`` runs those.

A benchmark is a public module of this package with either ``run()`` (returning its
figures) and ``report(figures)`` (the lines to print), or a ``main()`` that prints them.
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
from types import ModuleType


def _runnable(module: ModuleType) -> bool:
    has = lambda name: callable(getattr(module, name, None))  # noqa: E731
    return (has("run") and has("report")) or has("main")


def discover() -> list[str]:
    here = Path(__file__).parent
    names = []
    for info in pkgutil.iter_modules([str(here)]):
        if not info.name.startswith("_") and _runnable(importlib.import_module(f"benchmarks.{info.name}")):
            names.append(info.name)
    return sorted(names)


def _run_one(module: ModuleType) -> int:
    if callable(getattr(module, "run", None)) and callable(getattr(module, "report", None)):
        for line in module.report(module.run()):
            print(line, flush=True)
        return 0
    saved, sys.argv = sys.argv, [f"benchmarks/{module.__name__.rsplit('.', 1)[-1]}.py"]  # defaults
    try:
        rc: int = module.main([]) if inspect.signature(module.main).parameters else module.main()
    finally:
        sys.argv = saved
    return rc


def main(argv: Sequence[str] | None = None) -> int:
    wanted = list(argv if argv is not None else sys.argv[1:]) or discover()
    failed = []
    for name in wanted:
        print(f"=== benchmarks.{name}", flush=True)
        t0 = time.perf_counter()
        try:
            rc = _run_one(importlib.import_module(f"benchmarks.{name}"))
        except Exception:
            traceback.print_exc()
            rc = 1
        print(f"=== benchmarks.{name}: {'ok' if rc == 0 else 'FAILED'} in {time.perf_counter() - t0:.0f} s\n")
        if rc:
            failed.append(name)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
