"""Collector settings from ``STEPWATCH_*`` environment variables (pydantic-settings).

Created by the app factory or the CLI, never at import time, so tests and replicas can
run several collectors with different settings in one process.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="STEPWATCH_", extra="ignore")

    database_url: str = Field(
        default="sqlite:///stepwatch.db",
        description="SQLAlchemy URL. Default: a SQLite file in the working directory; "
        "production: postgresql+psycopg://user@host/db",
    )
    host: str = "127.0.0.1"
    port: int = 8321
    #: Largest accepted request body; a window of 1,024 steps is about 40 KB of JSON.
    max_body_bytes: int = 2 * 1024 * 1024
    #: Longest per-step array in one payload (the agent sends at most 1,024 by default).
    max_steps_per_batch: int = 10_000
    #: Target wall time of one stored per-rank window; the step count is fixed per run.
    window_seconds: float = 10.0
    #: Apply migrations when ``serve`` starts.
    migrate_on_start: bool = True
    # -- /metrics: what the Prometheus exposition may contain (bounded cardinality) --
    #: Most runs exported; the most recently reporting win.
    metrics_max_runs: int = Field(default=50, ge=1, le=10_000)
    #: Per-rank series for the K slowest ranks of a run (plus its flagged ranks).
    metrics_top_k: int = Field(default=8, ge=0, le=1_000)
    #: Most flagged (straggler) ranks exported per run, costliest first.
    metrics_max_flagged: int = Field(default=16, ge=0, le=1_000)
    #: A run with no batch for this long disappears from /metrics.
    metrics_run_expiry_s: float = Field(default=3600.0, gt=0)
    #: Most recent job steps read per run and scrape (current values, tags, hang threshold).
    metrics_recent_steps: int = Field(default=256, ge=16, le=100_000)
    #: Untagged steps after warm-up that form a run's frozen baseline.
    metrics_baseline_steps: int = Field(default=100, ge=1, le=100_000)
