"""Pieces of the real-training harness that depend on the machine it runs on."""

from __future__ import annotations

import sys
import time

from stepwatch_server.evaluation.real import Stillness, autogroup_nice

from ..wait import wait_until


def test_the_autogroup_niceness_is_read_where_the_kernel_keeps_one_and_none_elsewhere() -> None:
    assert autogroup_nice("/autogroup-103 nice 0\n") == "0"
    assert autogroup_nice("/autogroup-7 nice -20") == "-20"
    # CI machines with sched_autogroup_enabled=0 show an empty file: not an IndexError.
    assert autogroup_nice("") is None
    assert autogroup_nice("garbage") is None


def test_stillness_measures_a_stretch_in_which_its_thread_could_not_run() -> None:
    """Every thread of this process held off for 0.6 s (the main thread keeps the GIL: a
    long switch interval and a busy loop), as every process is when the machine stops."""
    before = sys.getswitchinterval()
    with Stillness(interval_s=0.01) as still:
        wait_until(lambda: still.at is not None, "the watcher's first wake-up", every_s=0.001)
        sys.setswitchinterval(5.0)
        try:
            start_wall, start = time.time(), time.monotonic()
            while time.monotonic() - start < 0.6:
                pass
        finally:
            sys.setswitchinterval(before)
        end_wall = time.time()
    assert still.longest_s >= 0.5, still.longest_s
    # When it began: before the busy loop ended (a load that held the thread off longer
    # before the loop could only move it earlier).
    assert still.at is not None and still.at <= end_wall - 0.5, (still.at, start_wall, end_wall)
