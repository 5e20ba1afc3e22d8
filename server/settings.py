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
    #: Seconds a client is told to wait (``Retry-After``) while the database is away.
    retry_after_s: int = Field(default=5, ge=1, le=600)
    #: Apply migrations when ``serve`` starts.
    migrate_on_start: bool = True
    #: uvicorn worker processes (each one group-commits on its own; 2 suit 2 cores).
    workers: int = Field(default=1, ge=1, le=64)
    #: Bearer tokens allowed to POST /ingest: ``[name=]secret`` or ``[name=]sha256:<hex>``,
    #: comma-separated. Empty: writes are open (development default).
    write_tokens: str = Field(default="", repr=False)
    #: Bearer tokens allowed to read the API (same syntax). Empty: reads are open.
    read_tokens: str = Field(default="", repr=False)
    #: Require a read token for /metrics too (Prometheus then sends ``authorization``).
    metrics_require_token: bool = False
    #: Browser origins allowed to read the API (comma-separated). Empty: CORS off.
    cors_origins: str = ""
    #: Runs one token (or, with writes open, everyone together) may create.
    max_runs_per_token: int = Field(default=1000, ge=1)
    #: Largest world size a run may declare.
    max_ranks_per_run: int = Field(default=65_536, ge=1, le=1_048_576)
