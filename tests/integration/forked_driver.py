"""Runs ``launch.forked`` in a process of its own (``python -m``), so that its forkserver
is the one ``forked`` starts, whatever a test worker started before: prints one JSON line
per rank, with its return code, the environment it asked for and its whole output."""

from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile
import time

from stepwatch.demo import launch

CHILD = "tests.integration.forked_child"


def _own_line(log: str, pid: int) -> None:
    """Until the rank wrote its line (the one with its pid; a forked rank's first)."""
    while True:
        with open(log) as f:
            line = f.readline()
        if line.startswith("{") and line.endswith("\n") and json.loads(line)["pid"] == pid:
            return
        time.sleep(0.01)


def main() -> None:
    netns = sys.argv[1]
    base = {**os.environ, "OMP_NUM_THREADS": "1", "ONLY_IN_RANK": "yes"}
    os.environ["NOT_IN_RANK"] = "yes"  # the forkserver has it, the ranks ask for an env without it
    allocator = {**base, "MALLOC_TRIM_THRESHOLD_": str(1 << 30), "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}
    cases: list[tuple[str, list[str], dict[str, str], int, str | None]] = [
        ("exits 3", ["3"], base, 7, None),
        ("killed", ["sleep"], base, 0, None),
        ("interrupted", ["interrupt"], base, 0, None),
        ("raises", ["raise"], base, 0, None),
        ("other OMP", ["0"], {**base, "OMP_NUM_THREADS": "2"}, 0, None),
        ("other TORCH_LOGS", ["0"], {**base, "TORCH_LOGS": "+dynamo"}, 0, None),
        ("allocator", ["0"], allocator, 0, None),
        ("netns", ["0"], base, 0, netns),
    ]
    with tempfile.TemporaryDirectory() as work:
        for i, (name, argv, env, nice, ns) in enumerate(cases):
            log = os.path.join(work, f"rank{i}.log")
            p = launch.forked(CHILD, argv, env=env, log_path=log, nice=nice, netns=ns)
            if argv == ["sleep"]:
                _own_line(log, p.pid)
                p.kill()
            rc = p.wait(120)
            p.kill()  # after it exited: reaches nobody
            with open(log) as f:
                text = f.read()
            seen = json.loads(next(line for line in text.splitlines() if line.startswith("{")))
            print(json.dumps({"case": name, "rc": rc, "asked": env, "seen": seen, "log": text}), flush=True)
    # forked() set the forkserver's variables for its start only.
    print(json.dumps({"case": "parent", "env": dict(os.environ), "nice": os.nice(0)}), flush=True)
    # What importing the preloaded modules adds to the environment (a rank gets it too).
    before = dict(os.environ)
    for name in launch.PRELOAD:
        importlib.import_module(name)
    added = {k: v for k, v in os.environ.items() if k not in before}
    print(json.dumps({"case": "imports", "added": added}), flush=True)


if __name__ == "__main__":
    main()
