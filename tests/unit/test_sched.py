"""The training thread's run-queue wait (``stepwatch._sched``), measured for real: this
thread pinned to one core beside CPU burners pinned to it (started and stopped by PID),
then asleep. Linux only, as the product's measurement (these machines and CI are Linux)."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator

import pytest

import stepwatch
from stepwatch._env import detect
from stepwatch._sched import RunQueueClock
from stepwatch._sender import MemorySink, SenderStats
from stepwatch.config import AgentConfig
from stepwatch_server.evaluation.real import cpu_burner
from stepwatch_server.schemas.ingest import IngestPayload

BURNERS = 2  # on this thread's core: it gets about a third of it


@contextlib.contextmanager
def beside_burners() -> Iterator[None]:
    """This thread and ``BURNERS`` busy loops on one core, for the ``with`` block."""
    before = os.sched_getaffinity(0)
    core = {min(before)}
    os.sched_setaffinity(0, core)  # 0: the calling thread
    try:
        with cpu_burner(BURNERS) as pids:
            for pid in pids:
                os.sched_setaffinity(pid, core)
            yield
    finally:
        os.sched_setaffinity(0, before)


def spin(cpu_s: float) -> float:
    """Busy this thread for ``cpu_s`` of its own CPU time; returns the wall time it took."""
    t0, c0 = time.perf_counter(), time.thread_time()
    x = 0
    while time.thread_time() - c0 < cpu_s:
        x += 1
    return time.perf_counter() - t0


def test_a_thread_waiting_for_a_core_accrues_run_queue_wait_and_a_sleeping_one_does_not() -> None:
    with beside_burners():
        clock = RunQueueClock()
        wall = spin(0.15)
        busy = clock.take()
        time.sleep(0.3)  # the stall under test, not a synchronisation
        asleep = clock.take()
    assert busy is not None and asleep is not None
    # A thread that never blocks is off its core only while it waits for it: nearly all
    # of its wall time beyond its CPU time is run-queue wait.
    assert busy >= 0.7 * (wall - 0.15) and busy >= 0.1, (busy, wall)
    assert asleep < 0.05 < busy, (asleep, busy)


def test_a_take_from_another_thread_reads_the_measured_threads_wait() -> None:
    """``flush()`` and ``close()`` may run on another thread than the training thread: they
    must read the training thread's wait, not start measuring the caller."""
    made: list[RunQueueClock] = []
    spun, taken = threading.Event(), threading.Event()

    def training() -> None:
        with beside_burners():  # pins this thread
            made.append(RunQueueClock())
            spin(0.15)
        spun.set()
        taken.wait()  # alive while the other thread reads its counter

    t = threading.Thread(target=training)
    t.start()
    spun.wait()
    got = made[0].take()  # from this (idle) thread
    taken.set()
    t.join()
    assert got is not None and got >= 0.1, got


#: Each stalled step's sleep: long beside a wake-up's wait for a core on a loaded machine.
STALL_S = 0.05


def test_each_window_carries_its_run_queue_wait_in_a_valid_comm_section() -> None:
    rec = MemorySink()
    cfg = AgentConfig(run="r", max_window_steps=4, send_interval_s=1e9, warmup_steps=0)
    sw = stepwatch.Stepwatch(cfg, detect({}, host="h"), convention=None, sender=rec)
    with beside_burners():
        for _ in range(4):
            spin(0.02)
            sw.comm_timing.done(sw.comm_timing.arrive("world", 0, 8), "world")
            sw.step(tokens=1)
    for _ in range(4):
        time.sleep(STALL_S)  # steps that stall: asleep, not waiting for a core
        sw.comm_timing.done(sw.comm_timing.arrive("world", 0, 8), "world")
        sw.step(tokens=1)
    sw.flush()
    busy, stalled = rec.windows
    assert busy.runq_s is not None and stalled.runq_s is not None
    # Time asleep is not run-queue wait: under half of what the stalled steps slept. Each
    # wake-up may still wait for a core on a loaded machine (CI, 4 test workers on 2
    # cores: 23 ms over four wake-ups, over the 20 ms this bound was with 20 ms steps).
    assert busy.runq_s > 0.04 and stalled.runq_s < 0.5 * 4 * STALL_S, (busy.runq_s, stalled.runq_s)
    body = json.loads(sw._encode(busy, SenderStats()))
    assert body["comm"]["runq_s"] == pytest.approx(busy.runq_s, abs=1e-6)
    p = IngestPayload.model_validate(body)
    assert p.comm is not None and p.comm.runq_s == pytest.approx(busy.runq_s, abs=1e-6)


def test_thread_busy_counts_work_and_waits_for_a_core_not_sleep() -> None:
    """``ThreadBusy`` (the DDP timing's end correction): the thread's own work counts in
    full, read while it runs (schedstat's CPU field alone lags by up to a tick); its wait
    for a core beside burners counts; a sleep does not."""
    from stepwatch._sched import ThreadBusy

    busy = ThreadBusy()
    b0 = busy.read()
    assert b0 is not None
    t = time.thread_time()
    while time.thread_time() - t < 0.005:  # 5 ms of work, about a tick
        pass
    b1 = busy.read()
    assert b1 is not None and b1 - b0 >= 5_000_000, b1 - b0
    time.sleep(0.2)
    b2 = busy.read()
    assert b2 is not None and b2 - b1 < 100_000_000, "a sleep is not busy time"
    with beside_burners():
        b3 = busy.read()
        w0 = time.perf_counter()
        while time.perf_counter() - w0 < 0.3:
            pass
        b4 = busy.read()
    assert b3 is not None and b4 is not None
    # The thread ran or waited for its core all along: busy time is the wall time.
    assert b4 - b3 >= 0.9 * 0.3e9, b4 - b3


def test_thread_busy_keeps_one_file_per_live_thread_and_never_grows() -> None:
    """Each thread reads its own counters; past the cap the files are reopened as
    needed, so 40 short-lived threads leave at most the cap open."""
    from stepwatch import _sched

    busy = _sched.ThreadBusy()
    got: list[int | None] = []

    def once() -> None:
        got.append(busy.read())

    for _ in range(40):
        th = threading.Thread(target=once)
        th.start()
        th.join()
    assert len(got) == 40 and all(v is not None for v in got), got
    assert len(busy._fds) <= _sched._MAX_THREADS
    busy.close()
    assert not busy._fds
