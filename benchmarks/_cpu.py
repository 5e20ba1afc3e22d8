"""CPU seconds of a process tree and of the local PostgreSQL server, read from ``/proc``.

A throughput ratio says how far the collector is from the database's own speed, not
where the difference goes. Read around each phase, these say which processes spent it:
the collector's (its web workers and analysis process), PostgreSQL's (every process of
the server, so a backend that exits during the phase is counted by its parent) and the
load generator's (this process). Linux only, and for PostgreSQL only a server on this
machine whose ``/proc`` entries this user may read; elsewhere the readers return None and
the benchmark prints no split.
"""

from __future__ import annotations

import os
import time
from typing import Any

import psycopg

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
#: CPU of (the collector's processes, the PostgreSQL server, this process); None where
#: that process could not be read.
Split = tuple[float | None, float | None, float]


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (field 3 onwards)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()


def _own_and_reaped_s(fields: list[str]) -> float:
    """utime + stime + cutime + cstime (fields 14-17): the process and its reaped children."""
    return sum(int(v) for v in fields[11:15]) * _TICK_S


def tree_cpu_s(root: int) -> float | None:
    """CPU seconds of ``root`` and every live descendant, each with its reaped children;
    None if ``root`` cannot be read (gone, or not Linux)."""
    if _stat(root) is None:
        return None
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields is not None:
                stats[int(entry)] = fields
                children.setdefault(int(fields[1]), []).append(int(entry))  # field 4: ppid
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            total += _own_and_reaped_s(stats[pid])
        todo.extend(children.get(pid, ()))
    return total


def postgres_server_pid(conn: psycopg.Connection[Any]) -> int | None:
    """The postmaster of ``conn``'s server (its backend's parent), if it runs here and is
    readable."""
    row = conn.execute("SELECT pg_backend_pid()").fetchone()
    fields = _stat(int(row[0])) if row is not None else None
    if fields is None:
        return None
    postmaster = int(fields[1])
    return postmaster if _stat(postmaster) is not None else None


class Meter:
    """CPU seconds spent between :meth:`start` and :meth:`stop` by the collector's process
    tree, the PostgreSQL server and this process (the load generator or COPY client)."""

    def __init__(self, collector_pid: int | None, postgres_pid: int | None) -> None:
        self.collector_pid = collector_pid
        self.postgres_pid = postgres_pid
        self._start: Split = (None, None, 0.0)

    def _read(self) -> Split:
        collector = tree_cpu_s(self.collector_pid) if self.collector_pid is not None else None
        postgres = tree_cpu_s(self.postgres_pid) if self.postgres_pid is not None else None
        return collector, postgres, time.process_time()

    def start(self) -> None:
        self._start = self._read()

    def stop(self) -> Split:
        """(collector, PostgreSQL, this process) seconds since :meth:`start`; None where
        that process could not be read."""
        end = self._read()
        return (
            None if end[0] is None or self._start[0] is None else end[0] - self._start[0],
            None if end[1] is None or self._start[1] is None else end[1] - self._start[1],
            end[2] - self._start[2],
        )
