"""The training thread's run-queue wait, read once per window close (Linux schedstat).

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
