"""Ranks forked from the preloaded forkserver (``launch.forked``, the evaluation harness'
launcher) are what ``[ip netns exec NS] nice -n N python -m MODULE ARGS`` with the same
environment would be: their own argv, exactly the asked environment, their niceness,
their network namespace, their exit code (``-9`` when killed), with torch already
imported. A rank that asks for a variable read at a process' start (here
``OMP_NUM_THREADS``) other than the forkserver's gets a fresh interpreter instead; the
allocator's settings that ``mallopt`` can set, it sets in the forked rank.

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

    ran = cases["exits 3"]
    seen = ran["seen"]
    assert ran["rc"] == 3
    assert seen["preloaded"], "torch was imported by the forkserver, not by the rank"
    assert seen["argv"] == ["3"] and seen["main"] == "__main__"
    assert seen["env"] == ran["asked"], "exactly the asked environment, nothing of the parent's beside"
    assert seen["env"]["ONLY_IN_RANK"] == "yes" and seen["env"]["OMP_NUM_THREADS"] == "1"
    assert "NOT_IN_RANK" not in seen["env"]
    assert seen["nice"] == cases["parent"]["nice"] + 7
    assert seen["interfaces"] == here

    killed = cases["killed"]
    assert killed["rc"] == -9 and killed["seen"]["preloaded"]

    other = cases["other OMP"]
    assert other["rc"] == 0
    assert not other["seen"]["preloaded"], "a variable read at start differs: a fresh interpreter"
    assert other["seen"]["env"] == other["asked"] and other["seen"]["env"]["OMP_NUM_THREADS"] == "2"

    # The allocator's settings, read at start by glibc, set by mallopt in a forked rank: a
    # freed 24 MiB block stays on the heap (mmap threshold 32 MiB, trim threshold 1 GiB),
    # where with the defaults it was mapped apart or trimmed.
    alloc = cases["allocator"]
    assert alloc["rc"] == 0 and alloc["seen"]["preloaded"], "one forkserver for ranks with and without"
    assert alloc["seen"]["env"] == alloc["asked"]
    assert alloc["seen"]["kept"] >= 24 << 20 > seen["kept"], (alloc["seen"]["kept"], seen["kept"])

    inside = cases["netns"]
    assert inside["rc"] == 0 and inside["seen"]["preloaded"]
    assert inside["seen"]["interfaces"] == ["lo"], "in the new namespace: its loopback only"
    assert here != ["lo"]

    parent = cases["parent"]
    assert "OMP_NUM_THREADS" not in parent["env"], "the forkserver's variables were set for its start only"
