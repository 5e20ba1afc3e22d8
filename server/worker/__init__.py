"""The collector's analysis worker: stored windows in, straggler/regression/hang events out.

- :mod:`.loop`: the worker thread and one pass per run (locking, state, events).
- :mod:`.readiness`: which windows are complete enough to analyse (pure).
- :mod:`.inputs` / :mod:`.outputs`: the reads and writes, rows to plain dataclasses.
"""

from __future__ import annotations

from .loop import AnalysisWorker, PassReport, WorkerConfig

__all__ = ["AnalysisWorker", "PassReport", "WorkerConfig"]
