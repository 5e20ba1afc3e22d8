"""The analysis worker in a process of its own, beside ``stepwatch serve``'s web workers.

Why a process: a pass is CPU-bound Python. As a thread of a web worker it shares that
interpreter's GIL with ingest, and every request the web worker is answering waits while
the pass runs: in the ingest benchmark's paced phase (4,096 simulated ranks, 100,000
rank-steps/s offered, each collector first given the same backlog to analyse) the POST
p99 was 137-186 ms with the worker as a thread, 37-49 ms with it in its own process and
24-30 ms without analysis in four runs (``python -m benchmarks.ingest`` prints all
three). Its state already lives in the database and its runs are taken under locks
(``loop.py``), so a separate process changes nothing of what it flags.

Where: :func:`analysis_apart` decides. PostgreSQL: a process (any number of processes may
write it). SQLite: a thread, since one process owns the file (``STEPWATCH_ANALYSIS_MODE``
overrides either way).

Lifecycle: :class:`AnalysisProcess` (in ``serve``) spawns it, restarts it if it dies and
stops it with SIGTERM when ``serve`` stops (SIGTERMed itself, ``serve`` stops its web
workers, then this process, then dies of the signal). The child asks the kernel for a
SIGTERM when its parent dies (``PR_SET_PDEATHSIG``), so a SIGKILLed ``serve`` leaves no
analysis running. Its counters reach ``/metrics`` through prometheus_client's multiprocess mode
(``exporter/registry.py``), summed with the web workers'.

:func:`build_analysis` is the one place the worker and its webhook are assembled from the
settings, for the thread (``app.create_app``) and the process alike.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
from multiprocessing.process import BaseProcess

from sqlalchemy.engine import make_url

from ..analysis.regressions import RegressionConfig
from ..children import as_child_of
from ..exporter.registry import CollectorMetrics
from ..settings import Settings
from ..storage.backend import Storage, open_storage
from ..storage.engine import make_engine
from .captures import CaptureConfig
from .loop import AnalysisWorker, WorkerConfig
from .webhook import WebhookNotifier

log = logging.getLogger(__name__)

#: Seconds before a dead analysis process is started again (it died of a bug or was
#: killed; the database being away does not kill it, its passes retry).
RESTART_DELAY_S = 5.0
#: The analysis process's name (at most 15 bytes: the kernel's limit).
PROCESS_NAME = "sw-analysis"


def analysis_apart(settings: Settings) -> bool:
    """Whether ``serve`` runs the analysis in its own process (else a thread of each web
    worker): ``STEPWATCH_ANALYSIS_MODE``, where ``auto`` means a process on PostgreSQL
    and a thread on SQLite."""
    if settings.analysis_mode != "auto":
        return settings.analysis_mode == "process"
    return make_url(settings.database_url).get_backend_name() == "postgresql"


def worker_config(settings: Settings) -> WorkerConfig:
    return WorkerConfig(
        interval_s=settings.analysis_interval_s,
        summary_top=settings.metrics_top_k,
        grace_s=settings.analysis_grace_s,
        horizon_s=settings.analysis_horizon_s,
        hang_k=settings.hang_k,
        hang_floor_s=settings.hang_floor_s,
        hang_startup_s=settings.hang_startup_s,
        regressions=RegressionConfig(
            baseline_samples=settings.analysis_baseline_windows,
            baseline_max=max(RegressionConfig().baseline_max, settings.analysis_baseline_windows),
        ),
        captures=CaptureConfig(
            on_flag=settings.capture_on_flag,
            min_interval_s=settings.capture_min_interval_s,
            steps=settings.capture_steps,
            max_cost_s=settings.capture_max_cost_s,
            max_bytes=settings.trace_max_bytes,
        ),
    )


def build_analysis(
    settings: Settings, storage: Storage, metrics: CollectorMetrics
) -> tuple[AnalysisWorker, WebhookNotifier | None]:
    """The analysis worker over ``storage`` and the webhook it notifies (None unless
    ``STEPWATCH_WEBHOOK_URL``), counting into ``metrics``; neither started."""
    notifier: WebhookNotifier | None = None
    if settings.webhook_url:
        notifier = WebhookNotifier(
            settings.webhook_url,
            fmt=settings.webhook_format,
            timeout_s=settings.webhook_timeout_s,
            max_attempts=settings.webhook_max_attempts,
            resend_s=settings.webhook_resend_s,
            public_url=settings.public_url,
            on_outcome=lambda outcome: metrics.webhook.labels(outcome).inc(),
        )
    worker = AnalysisWorker(
        storage,
        worker_config(settings),
        notify=notifier.notify if notifier is not None else None,
        on_pass=metrics.record_pass,
    )
    return worker, notifier


class AnalysisProcess:
    """The parent's handle on the analysis process: started with ``serve``, started again
    if it dies, stopped (SIGTERM, then SIGKILL after ``timeout_s``) when ``serve`` stops."""

    def __init__(self, settings: Settings, log_level: str = "info") -> None:
        self._settings = settings
        self._log_level = log_level
        self._ctx = multiprocessing.get_context("spawn")  # a fresh interpreter, no inherited locks
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._proc: BaseProcess | None = None
        self._monitor: threading.Thread | None = None

    def start(self) -> None:
        with self._lock:
            self._proc = self._spawn()
        # Restarts are spawned by the monitor, which lives until stop: PR_SET_PDEATHSIG
        # fires when the spawning *thread* ends, so no thread that ends early spawns.
        self._monitor = threading.Thread(target=self._watch, name="stepwatch-analysis-monitor", daemon=True)
        self._monitor.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``. The monitor alone reaps the child
        (two threads waiting on one pid could each miss its exit)."""
        self._stopping.set()
        with self._lock:
            proc = self._proc
        if proc is not None:
            proc.terminate()  # a no-op once reaped
        if self._monitor is not None:
            self._monitor.join(timeout_s)
            if self._monitor.is_alive() and proc is not None:
                log.warning("the analysis process did not stop within %.0f s; killed", timeout_s)
                proc.kill()
                self._monitor.join()

    def _spawn(self) -> BaseProcess:
        proc = self._ctx.Process(
            target=run_analysis,
            args=(self._settings, self._log_level, os.getpid()),
            name="stepwatch-analysis",
        )
        proc.start()
        log.info("analysis worker started as process %s", proc.pid)
        return proc

    def _watch(self) -> None:
        while True:
            with self._lock:
                proc = self._proc
            if proc is not None:
                proc.join()
                if self._stopping.is_set():
                    return
                log.error(
                    "the analysis process %s exited with %s; starting another in %.0f s",
                    proc.pid,
                    proc.exitcode,
                    RESTART_DELAY_S,
                )
            if self._stopping.wait(RESTART_DELAY_S):
                return
            with self._lock:
                if self._stopping.is_set():
                    return
                try:
                    self._proc = self._spawn()
                except Exception:  # out of processes, memory or descriptors: try again later
                    log.exception("could not start the analysis process")
                    self._proc = None


def run_analysis(settings: Settings, log_level: str, parent_pid: int) -> None:
    """The analysis process: passes until SIGTERM (from ``serve``, or from the kernel when
    ``serve`` dies), taken with ``sigwait`` by the main thread (a handler that sets an
    event could interrupt that event's own wait while it holds its lock). SIGINT is
    ignored: a Ctrl-C reaches the whole process group, and ``serve`` stops this process
    once its web workers have stopped."""
    as_child_of(parent_pid, PROCESS_NAME)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # inherited by the threads below
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = make_engine(settings.database_url)
    worker, notifier = build_analysis(settings, open_storage(engine), CollectorMetrics())
    if notifier is not None:
        notifier.start()
    worker.start()
    try:
        signal.sigwait({signal.SIGTERM})
    finally:
        worker.stop()
        if notifier is not None:
            notifier.close()
        engine.dispose()
