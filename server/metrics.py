"""Prometheus exposition, built at scrape time from the collector's own counters.

The registry belongs to the app (never the global default), so several collectors can
live in one process (tests, replicas). Run, rank and flag families come from the custom
collector in ``exporter/``, which the app factory registers here.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram


class CollectorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.batches = Counter(
            "stepwatch_ingest_batches",
            "Batches received, by outcome (stored, duplicate, rejected).",
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
