"""Prometheus exposition, built at scrape time from the collector's own counters.

The registry belongs to the app (never the global default), so several collectors can
live in one process (tests, replicas). Run, rank and flag families come from the custom
collector in ``exporter/``, which the app factory registers here.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from ..worker import PassReport


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

    def record_pass(self, report: PassReport, seconds: float) -> None:
        """Called by the analysis worker after every pass."""
        self.analysis_seconds.observe(seconds)
        self.analysis_windows.inc(report.windows)
        self.analysis_errors.inc(report.errors)
        for _, t in report.transitions:
            self.event_transitions.labels(t.finding.kind, t.finding.status).inc()
