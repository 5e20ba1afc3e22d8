"""Ranks forked from the preloaded forkserver (``launch.forked``: the demo's, the tests'
and the evaluation harness' launcher) are what ``[ip netns exec NS] nice -n N python -m
MODULE ARGS`` with the same environment would be: their own argv, exactly the asked
environment, their niceness, their network namespace, their exit code (``-9`` killed,
``-2`` by an uncaught KeyboardInterrupt, 1 with the traceback for an uncaught error), the
output the interpreter flushes at exit, with torch already imported. A rank that asks for a
variable read before its own code runs (``OMP_NUM_THREADS`` when OpenMP loads,
``TORCH_LOGS`` when torch is imported) other than the forkserver's gets a fresh
interpreter instead; the allocator's settings that ``mallopt`` can set, it sets in the
forked rank.

Real processes: a driver (``forked_driver.py``) run as a process of its own, so that the
forkserver is the one ``forked`` starts whatever this test worker started before, forks
``forked_child.py`` in each case; root makes the network namespace, as the harness does.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 31 << 20  # forked_child.BLOCK


def _run_driver(netns: str) -> dict[str, dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run(
        [sys.executable, "-m", "tests.integration.forked_driver", netns],
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    return {(x := json.loads(line))["case"]: x for line in out.splitlines()}


def test_a_forked_rank_is_the_process_its_command_line_would_be() -> None:
    ns = f"swfk{os.getpid() % 100000}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        cases = _run_driver(ns)
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=True)
    here = sorted(name for _, name in socket.if_nameindex())

    forked = ("exits 3", "killed", "interrupted", "raises", "allocator", "netns")
    assert not [n for n in forked if "fresh interpreter" in cases[n]["log"]], "forked, not started afresh"
    ran = cases["exits 3"]
    seen = ran["seen"]
    assert ran["rc"] == 3
    assert seen["preloaded"], "torch was imported by the forkserver, not by the rank"
    assert seen["argv"] == ["3"] and seen["main"] == "__main__"
    # Exactly the asked environment, with what the preloaded imports add (as they would
    # in the rank), nothing of the parent's beside.
    added = cases["imports"]["added"]
    assert seen["env"] == {**added, **ran["asked"]}
    assert seen["env"]["ONLY_IN_RANK"] == "yes" and seen["env"]["OMP_NUM_THREADS"] == "1"
    assert "NOT_IN_RANK" not in seen["env"]
    assert seen["nice"] == cases["parent"]["nice"] + 7
    assert seen["interfaces"] == here
    assert ran["log"].endswith("last line, not flushed\n"), "the exit flushed what the rank wrote last"

    killed = cases["killed"]
    assert killed["rc"] == -9 and killed["seen"]["preloaded"]
    assert "last line" not in killed["log"]

    interrupted = cases["interrupted"]
    assert interrupted["rc"] == -2 and interrupted["seen"]["preloaded"], "as python dies of an uncaught ^C"
    assert "KeyboardInterrupt" in interrupted["log"] and "last line, not flushed" in interrupted["log"]
    raised = cases["raises"]
    assert raised["rc"] == 1 and "ValueError: the rank failed" in raised["log"]
    assert "Traceback" in raised["log"] and "last line, not flushed" in raised["log"]

    for name, var, value in (
        ("other OMP", "OMP_NUM_THREADS", "2"),
        ("other TORCH_LOGS", "TORCH_LOGS", "+dynamo"),
    ):
        other = cases[name]
        assert other["rc"] == 0
        assert not other["seen"]["preloaded"], f"{var} differs from the server's: a fresh interpreter"
        assert f"a fresh interpreter, not forked: {var} differ from the forkserver's" in other["log"]
        assert (
            other["seen"]["env"] == other["asked"] and other["seen"]["env"][var] == value
        )  # no import added

    # The allocator's settings, read at start by glibc, set by mallopt in a forked rank: a
    # freed 31 MiB block stays on the heap (mmap threshold 32 MiB, trim threshold 1 GiB),
    # where with the defaults it was mapped apart (glibc's moving threshold stops at 32 MiB
    # only after a block that size was freed) or trimmed.
    alloc = cases["allocator"]
    assert alloc["rc"] == 0 and alloc["seen"]["preloaded"], "one forkserver for ranks with and without"
    assert alloc["seen"]["env"] == {**added, **alloc["asked"]}
    assert alloc["seen"]["kept"] >= BLOCK > seen["kept"], (alloc["seen"]["kept"], seen["kept"])

    inside = cases["netns"]
    assert inside["rc"] == 0 and inside["seen"]["preloaded"]
    assert inside["seen"]["interfaces"] == ["lo"], "in the new namespace: its loopback only"
    assert here != ["lo"]

    parent = cases["parent"]
    assert "OMP_NUM_THREADS" not in parent["env"], "the forkserver's variables were set for its start only"
    assert parent["env"]["NOT_IN_RANK"] == "yes"
