"""What each process ``stepwatch serve`` spawns does first (Linux; elsewhere nothing):
name itself, so that ``ps``, ``top`` and ``/proc/PID/comm`` tell the processes apart, and
ask the kernel for SIGTERM when its parent dies (``PR_SET_PDEATHSIG``), so that a
SIGKILLed ``serve`` leaves no web worker or analysis running. The signal fires when the
spawning *thread* ends: spawn from a thread that lives as long as ``serve``."""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def as_child_of(parent_pid: int, name: str) -> None:
    """Name this process ``name`` (at most 15 bytes: the kernel's limit) and ask for
    SIGTERM when ``parent_pid`` dies; if it already has, SIGTERM now."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode(), 0, 0, 0)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)
