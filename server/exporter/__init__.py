"""Prometheus exposition of the collector's state (runs, ranks, flags), built per scrape."""

from __future__ import annotations

from .catalog import FAMILIES, Family, series_bound
from .collector import ExporterConfig, RunStateCollector

__all__ = ["FAMILIES", "ExporterConfig", "Family", "RunStateCollector", "series_bound"]
