"""The training thread's run-queue wait, read once per window close (Linux schedstat), and
a thread's busy time (CPU plus run-queue wait), read twice per step by the DDP timing.

Why: a rank that arrives last at the collectives without doing more work than its peers
either stalled (a sleep, a blocking call: its thread was off the CPU and not runnable) or
waited for a core (runnable, but the host's cores were busy with other work). The first
is a host stall worth naming; the second is contention for the host's CPUs, which on a
busy machine falls on one rank, then another, by the scheduler's chance. The kernel
tells them apart: ``/proc/<pid>/task/<tid>/schedstat`` holds the thread's CPU time, its
*run-queue wait* (time spent runnable, not running) and its time slices, cumulative, in
nanoseconds (``CONFIG_SCHED_INFO``, on in every distribution kernel; no sysctl needed).
Measured on a 2-core machine: a busy thread beside three CPU burners for 2 s waited
0.99 s on the run queue; a sleeping thread, 0.01 s.

Cost: one ``pread`` of a file opened once (procfs regenerates it at offset 0), about
1.6 us, at each window close (every ``send_interval_s``), never per step. No I/O that can
block: procfs reads a counter of the kernel's task struct. The file is opened on the
thread that creates the agent (``init``, on the training thread), so it names that
thread's task whichever thread reads it later (a ``flush()`` or ``close()`` from another
thread still reads the training thread's wait); a process forked from the training
process reopens it, for its own thread.
Elsewhere than Linux, or when the file cannot be read, the wait is ``None`` (unmeasured).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

_NS = 1e-9


def _path(tid: int) -> str:
    return f"/proc/self/task/{tid}/schedstat"


class RunQueueClock:
    """Run-queue wait of the thread that created it, window by window."""

    __slots__ = ("_fd", "_last", "_pid")

    def __init__(self) -> None:
        self._fd = -1
        self._pid = 0
        self._last: int | None = None
        self._open()

    def _open(self) -> None:
        self._close_fd()
        self._pid = os.getpid()
        try:
            self._fd = os.open(_path(threading.get_native_id()), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            self._fd = -1
        self._last = self._read()

    def _close_fd(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
        self._fd = -1

    def _read(self) -> int | None:
        """Cumulative run-queue wait in nanoseconds, or None when not measured."""
        if self._fd < 0:
            return None
        try:
            return int(os.pread(self._fd, 96, 0).split()[1])
        except (OSError, ValueError, IndexError):
            return None

    def take(self) -> float | None:
        """Seconds the measured thread waited on the run queue since the previous call (or
        since construction); None when not measured, or in a process forked since (its
        calling thread is measured from now on)."""
        if os.getpid() != self._pid:
            self._open()
            return None
        now = self._read()
        last, self._last = self._last, now
        if now is None or last is None:
            return None
        return max(0, now - last) * _NS

    def close(self) -> None:
        self._close_fd()
        self._last = None

    def __del__(self) -> None:
        self._close_fd()


#: Threads whose schedstat :class:`ThreadBusy` keeps open (autograd's backward threads:
#: one per device and the caller); beyond that the files are closed and reopened as needed.
_MAX_THREADS = 16


class ThreadBusy:
    """CPU time plus run-queue wait of the calling thread, in nanoseconds: the time it
    was not asleep or blocked.

    Why: the per-step collective timing (``_ddp_timing``) reads the end of DDP's
    reduction on the training thread after DDP's finalisation, which first sleeps until
    the all-reduces have ended, then waits for a core to wake up on and copies the
    buckets into the gradients. On loaded shared cores the last two are milliseconds of
    noise that has nothing to do with the collective. Between the arrival and that read,
    the wall time minus this counter's growth is the time the thread slept waiting for
    the collective: the end without the wake-up and the copy-out.

    The CPU part is the thread's CPU clock (``thread_time_ns``): schedstat's own CPU
    field is updated only at the scheduler's ticks and context switches, so a read while
    the thread runs misses up to a tick (4 ms here) of it. The run-queue wait is
    schedstat's second field, which is current whenever the thread itself reads it (its
    last wait was added when it got the core). One ``pread`` of a file opened once per
    thread and one clock read per call (2.6 us in all here); None where schedstat cannot be
    read (not Linux), or after the thread's file went stale (its id now names another
    thread: reopened at the next call). Past :data:`_MAX_THREADS` threads the files
    are closed and opened again as needed, so nothing grows."""

    __slots__ = ("_fds", "_pid")

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}
        self._pid = os.getpid()

    def read(self) -> int | None:
        if os.getpid() != self._pid:  # forked: the open files name the parent's threads
            self.close()
            self._pid = os.getpid()
        tid = threading.get_native_id()
        fd = self._fds.get(tid)
        if fd is None:
            if len(self._fds) >= _MAX_THREADS:
                self.close()
            fd = -1
            with contextlib.suppress(OSError):
                fd = os.open(_path(tid), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            self._fds[tid] = fd
        if fd < 0:
            return None
        try:
            runq = int(os.pread(fd, 96, 0).split()[1])
        except (OSError, ValueError, IndexError):
            del self._fds[tid]  # a dead thread's file (its id reused): reopened next time
            with contextlib.suppress(OSError):
                os.close(fd)
            return None
        return time.thread_time_ns() + runq

    def close(self) -> None:
        for fd in self._fds.values():
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fds.clear()

    def __del__(self) -> None:
        self.close()
