"""Collector settings from ``STEPWATCH_*`` environment variables (pydantic-settings).

Created by the app factory or the CLI, never at import time, so tests and replicas can
run several collectors with different settings in one process.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from stepwatch import wire


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
    #: Seconds a client has to send a whole request (headers and body) once it starts one
    #: or connects; past it, 408 and the connection is closed (``api/timeouts.py``).
    request_read_timeout_s: float = Field(default=30.0, gt=0)
    #: Seconds an idle keep-alive connection stays open between requests.
    keep_alive_timeout_s: int = Field(default=5, ge=1)
    #: Concurrent connections (and requests) per worker process; past it, 503 at once.
    max_connections: int = Field(default=2048, ge=1)
    #: Target wall time of one stored per-rank window; the step count is fixed per run.
    window_seconds: float = 10.0
    #: Steps per stored window for every new run (a power of two); 0: chosen from each
    #: run's first batch and ``window_seconds``. Fixing it makes windows the same for runs
    #: whose first steps' pace differs (a loaded machine, a slow first batch).
    window_steps: int = Field(default=0, ge=0, le=4096)
    #: Seconds a client is told to wait (``Retry-After``) while the database is away.
    retry_after_s: int = Field(default=5, ge=1, le=600)
    #: Apply migrations when ``serve`` starts.
    migrate_on_start: bool = True
    #: uvicorn worker processes (each one group-commits on its own; 2 suit 2 cores).
    workers: int = Field(default=1, ge=1, le=64)
    #: Seconds a web worker's event loop may stop turning before the supervisor kills it
    #: and starts another, and a worker asked to stop may take (``serve --workers N`` on
    #: Linux, ``api/workers.py``); 30 as gunicorn's ``--timeout``.
    worker_timeout_s: float = Field(default=30.0, ge=1.0, le=3600.0)
    #: Bearer tokens allowed to POST /ingest: ``[name=]secret`` or ``[name=]sha256:<hex>``,
    #: comma-separated. Empty: writes are open (development default).
    write_tokens: str = Field(default="", repr=False)
    #: Bearer tokens allowed to read the API (same syntax). Empty: reads are open.
    read_tokens: str = Field(default="", repr=False)
    #: Bearer tokens allowed to steer the agents (captures, live settings) and to read.
    #: Steering is open only while no token of any kind is configured.
    admin_tokens: str = Field(default="", repr=False)
    #: Require a read token for /metrics too (Prometheus then sends ``authorization``).
    metrics_require_token: bool = False
    #: Browser origins allowed to read the API (comma-separated). Empty: CORS off.
    cors_origins: str = ""
    #: Runs one token (or, with writes open, everyone together) may create.
    max_runs_per_token: int = Field(default=1000, ge=1)
    #: Write-token names (comma-separated) that may post into runs other tokens created (a
    #: relay, a simulator); every other token writes only into the runs it created.
    shared_write_tokens: str = ""
    #: Largest world size a run may declare.
    max_ranks_per_run: int = Field(default=65_536, ge=1, le=1_048_576)
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

    # -- analysis (stragglers, regressions, hangs): a worker off the ingest path --
    #: Run the analysis worker in this collector (every replica may; one analyses a run at a time).
    analysis_enabled: bool = True
    #: Where ``serve`` runs it: ``process`` (its own, beside the web workers: no GIL shared
    #: with ingest), ``thread`` (one in each web worker), ``auto``: a process on PostgreSQL,
    #: a thread on SQLite (one process owns the file). See ``worker/process.py``.
    analysis_mode: Literal["auto", "process", "thread"] = "auto"
    #: Seconds between analysis passes.
    analysis_interval_s: float = Field(default=5.0, gt=0)
    #: A window some rank has not completed is analysed without it this long after newer
    #: data passed it (collector clock).
    analysis_grace_s: float = Field(default=60.0, ge=0)
    #: Runs without a batch for this long are no longer analysed (their flags stay as they are).
    analysis_horizon_s: float = Field(default=7 * 86_400.0, gt=0)
    #: Windows after warm-up that form a run's own regression baseline (it keeps learning
    #: from in-control windows after that, up to 120).
    analysis_baseline_windows: int = Field(default=12, ge=3, le=10_000)
    #: A hang is no step for longer than max(hang_k x median step time, hang_floor_s).
    hang_k: float = Field(default=10.0, gt=0)
    hang_floor_s: float = Field(default=60.0, ge=0)
    #: The threshold while a run has no step past its warm-up (compilation, first steps).
    hang_startup_s: float = Field(default=600.0, ge=0)

    # -- captures: the same steps profiled on a flagged rank and its peers --
    #: A straggler or regression flag that opens asks for a capture (at most one per run
    #: per ``capture_min_interval_s``).
    capture_on_flag: bool = True
    capture_min_interval_s: float = Field(default=600.0, ge=0)
    #: Steps a capture profiles unless asked otherwise.
    capture_steps: int = Field(default=4, ge=1, le=wire.MAX_CAPTURE_STEPS)
    #: A capture whose estimated cost per rank (from the run's measured profiler windows)
    #: exceeds this many seconds of training time is shortened, and says so.
    capture_max_cost_s: float = Field(default=5.0, gt=0)
    #: A capture's subject rank uploads its raw trace (gzipped) when at most this many
    #: bytes (0: no raw trace); within ``max_body_bytes``. ``stepwatch db prune`` deletes
    #: traces older than its ``--trace-days``.
    capture_max_bytes: int = Field(default=2 * 1024 * 1024, ge=0, le=1 << 30)

    # -- webhook for flags that open or close (optional) --
    webhook_url: str | None = None
    webhook_format: Literal["slack", "alertmanager"] = "slack"
    webhook_timeout_s: float = Field(default=5.0, gt=0)
    webhook_max_attempts: int = Field(default=8, ge=1)
    #: Alertmanager format: firing alerts are re-sent this often (Alertmanager resolves
    #: alerts it has not heard of for its resolve_timeout, 5 min by default).
    webhook_resend_s: float = Field(default=60.0, ge=0)
    #: Base URL of this collector as people reach it, for links in alerts.
    public_url: str | None = None

    @property
    def trace_max_bytes(self) -> int:
        """The largest raw trace kept: ``capture_max_bytes`` within a request's body cap."""
        return min(self.capture_max_bytes, self.max_body_bytes)

    @field_validator("window_steps")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        """Windows of a power of two steps, as the chosen ones: the retention's roll-up and
        the job-step buckets (64 steps) divide evenly into them or they into those."""
        if v and v & (v - 1):
            raise ValueError(f"window_steps must be 0 or a power of two, not {v}")
        return v
