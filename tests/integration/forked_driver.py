"""Runs ``launch.forked`` in a process of its own (``python -m``), so that its forkserver
is the one ``forked`` starts, whatever a test worker started before: prints one JSON line
per rank, with its return code and what it saw."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

from stepwatch.demo import launch

CHILD = "tests.integration.forked_child"


def main() -> None:
    netns = sys.argv[1] if len(sys.argv) > 1 else None
    base = {**os.environ, "OMP_NUM_THREADS": "1", "ONLY_IN_RANK": "yes"}
    os.environ["NOT_IN_RANK"] = "yes"  # the forkserver has it, the ranks ask for an env without it
    cases: list[tuple[str, list[str], dict[str, str], int, str | None]] = [
        ("exits 3", ["3"], base, 7, None),
        ("killed", ["sleep"], base, 0, None),
        ("other OMP", ["0"], {**base, "OMP_NUM_THREADS": "2"}, 0, None),
        (
            "allocator",
            ["0"],
            {**base, "MALLOC_TRIM_THRESHOLD_": str(1 << 30), "MALLOC_MMAP_THRESHOLD_": str(32 << 20)},
            0,
            None,
        ),
    ]
    if netns:
        cases.append(("netns", ["0"], base, 0, netns))
    with tempfile.TemporaryDirectory() as work:
        for name, argv, env, nice, ns in cases:
            log = os.path.join(work, "rank.log")
            p = launch.forked(CHILD, argv, env=env, log_path=log, nice=nice, netns=ns)
            if argv == ["sleep"]:
                with open(log) as f:  # the rank is running once it wrote its line
                    while not f.readline():
                        time.sleep(0.01)
                p.kill()
            rc = p.wait(120)
            p.kill()  # after it exited: reaches nobody
            with open(log) as f:
                seen = json.loads(f.readline())
            print(json.dumps({"case": name, "rc": rc, "asked": env, "seen": seen}), flush=True)
    # forked() set the forkserver's variables for its start only.
    print(json.dumps({"case": "parent", "env": dict(os.environ), "nice": os.nice(0)}), flush=True)


if __name__ == "__main__":
    main()
