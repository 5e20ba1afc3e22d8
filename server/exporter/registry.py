"""Prometheus exposition, built at scrape time from the collector's own counters.

The registry belongs to the app (never the global default), so several collectors can
live in one process (tests, replicas). Run, rank and flag families come from the custom
collector in ``exporter/``, which the app factory registers beside them.

Under ``stepwatch serve`` several processes may count: the web workers (``--workers``) and
the analysis process (``worker/process.py``). ``serve`` then runs prometheus_client's
multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``: each process writes its counters to files
there) and every scrape, whichever worker answers it, sums all of them; with one registry
per process a scrape would show the counters of whichever worker it reached, and none of
the analysis process.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, values
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from ..worker import PassReport

#: Set (by ``serve``) before the processes that count start: the multiprocess mode's files.
MULTIPROCESS_DIR = "PROMETHEUS_MULTIPROC_DIR"


@contextlib.contextmanager
def shared_counters() -> Iterator[str]:
    """Multiprocess mode for this process and those it starts (they inherit the
    environment), in a fresh directory removed afterwards; an operator's own
    ``PROMETHEUS_MULTIPROC_DIR`` is used as it is and kept."""
    given = os.environ.get(MULTIPROCESS_DIR)
    if given and not os.path.isdir(given):
        raise RuntimeError(f"{MULTIPROCESS_DIR}={given} is not a directory (its counters' files go there)")
    path = given or tempfile.mkdtemp(prefix="stepwatch-metrics-")
    os.environ[MULTIPROCESS_DIR] = path
    # prometheus_client picks its value class when first imported: this process may
    # have imported it already (counters created from now on write to the files).
    values.ValueClass = values.get_value_class()  # type: ignore[no-untyped-call]
    try:
        yield path
    finally:
        if given is None:
            del os.environ[MULTIPROCESS_DIR]
            values.ValueClass = values.get_value_class()  # type: ignore[no-untyped-call]
            shutil.rmtree(path, ignore_errors=True)


class CollectorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.batches = Counter(
            "stepwatch_ingest_batches",
            "Batches received, by outcome: stored, duplicate, or unstorable (the database refused "
            "a value the schema let through: answered 422, a bug to report).",
            ["outcome"],
            registry=self.registry,
        )
        self.steps = Counter("stepwatch_ingest_rank_steps", "Rank-steps stored.", registry=self.registry)
        self.ingest_seconds = Histogram(
            "stepwatch_ingest_duration_seconds",
            "Time to validate and commit one batch.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=self.registry,
        )
        self.group_batches = Histogram(
            "stepwatch_ingest_group_batches",
            "Batches written together in one transaction (group commit).",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
            registry=self.registry,
        )
        self.analysis_seconds = Histogram(
            "stepwatch_analysis_pass_duration_seconds",
            "Time of one analysis pass over all active runs.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=self.registry,
        )
        self.analysis_windows = Counter(
            "stepwatch_analysis_windows", "Windows analysed (all runs).", registry=self.registry
        )
        self.analysis_errors = Counter(
            "stepwatch_analysis_errors", "Runs whose analysis failed in a pass.", registry=self.registry
        )
        self.event_transitions = Counter(
            "stepwatch_event_transitions",
            "Flags that opened or closed, by kind and new status.",
            ["kind", "status"],
            registry=self.registry,
        )
        self.webhook = Counter(
            "stepwatch_webhook_notifications",
            "Webhook messages by outcome (delivered, failed, dropped).",
            ["outcome"],
            registry=self.registry,
        )

    def exposition(self, *collectors: Collector) -> CollectorRegistry:
        """What ``/metrics`` serves: these counters (summed over every process of this
        ``serve`` in multiprocess mode) and ``collectors``, read at each scrape."""
        registry = self.registry
        if MULTIPROCESS_DIR in os.environ:
            registry = CollectorRegistry(auto_describe=True)
            MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        for c in collectors:
            registry.register(c)
        return registry

    def record_pass(self, report: PassReport, seconds: float) -> None:
        """Called by the analysis worker after every pass."""
        self.analysis_seconds.observe(seconds)
        self.analysis_windows.inc(report.windows)
        self.analysis_errors.inc(report.errors)
        for _, t in report.transitions:
            self.event_transitions.labels(t.finding.kind, t.finding.status).inc()
