"""Pieces of the real-training harness that depend on the machine it runs on."""

from __future__ import annotations

from stepwatch_server.evaluation.real import autogroup_nice


def test_the_autogroup_niceness_is_read_where_the_kernel_keeps_one_and_none_elsewhere() -> None:
    assert autogroup_nice("/autogroup-103 nice 0\n") == "0"
    assert autogroup_nice("/autogroup-7 nice -20") == "-20"
    # CI machines with sched_autogroup_enabled=0 show an empty file: not an IndexError.
    assert autogroup_nice("") is None
    assert autogroup_nice("garbage") is None
