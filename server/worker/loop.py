"""The analysis worker: a daemon thread of the collector that turns stored windows into flags.

Ingest stays a short transaction that only stores; the analysis runs here, on its own
interval, out of the request path. Each pass:

1. finds the runs that received a batch within ``horizon_s`` (collector clock);
2. per run, in ONE transaction: takes the run's lock (PostgreSQL: a transaction-scoped
   advisory lock, ``pg_try_advisory_xact_lock``; a replica that does not get it skips
   the run this pass), loads the detectors' state, picks the windows that are complete
   (:mod:`.readiness`), feeds them in order to :class:`~..analysis.pipeline.RunAnalysis`,
   checks hangs from ``ranks.last_seen`` (:func:`~..analysis.hangs.check_hang`, ranks
   that sent their final batch excluded), upserts the events and writes the state back
   (compare-and-set on its version);
   then asks for the captures new flags call for and explains the answered ones
   (:mod:`.captures`);
3. after the commit, hands the flags that opened or closed to the webhook, if any.

Several collector replicas on one PostgreSQL therefore analyse each run one at a time,
each continuing from the state the previous pass committed: the flags depend only on the
windows, never on which replica saw them (tests run two collectors and compare). On
SQLite (one collector process) the reads run outside a write lock and the writes are a
short transaction at the end, so analysis never holds up ingest for longer than its writes.

Windows are analysed in order and each exactly once; a backlog (a collector that was
down, a restart) is worked off ``max_windows`` per transaction, several transactions per
pass.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone

from sqlalchemy import Connection

from ..analysis.hangs import check_hang, hang_threshold_s
from ..analysis.peers import StragglerConfig
from ..analysis.pipeline import Change, RunAnalysis
from ..analysis.regressions import Baseline, RegressionConfig
from ..analysis.types import Finding, RankWindow
from ..exporter import summaries
from ..reads.runs import RunInfo, find_run
from ..storage.backend import Storage
from . import captures, inputs
from .captures import CaptureConfig
from .outputs import (
    StateConflictError,
    StoredState,
    Transition,
    drop_step_timings,
    load_state,
    open_hangs,
    save_state,
    write_findings,
)
from .readiness import Readiness, ready_windows

log = logging.getLogger("stepwatch_server.analysis")


@dataclass(frozen=True)
class WorkerConfig:
    """Timing and thresholds of the analysis (``STEPWATCH_ANALYSIS_*``, ``STEPWATCH_HANG_*``)."""

    interval_s: float = 5.0
    grace_s: float = 60.0
    horizon_s: float = 7 * 86_400.0
    max_windows: int = 256
    max_batches_per_run: int = 16
    hang_k: float = 10.0
    hang_floor_s: float = 60.0
    hang_startup_s: float = 600.0
    stragglers: StragglerConfig = field(default_factory=StragglerConfig)
    regressions: RegressionConfig = field(default_factory=RegressionConfig)
    captures: CaptureConfig = field(default_factory=CaptureConfig)
    #: Slowest ranks stored with a window's summary for ``/metrics`` (its ``top_k``).
    summary_top: int = 8


@dataclass
class PassReport:
    """What one pass did (for tests, logs and metrics)."""

    runs: int = 0
    windows: int = 0
    locked: int = 0
    conflicts: int = 0
    errors: int = 0
    transitions: list[tuple[str, Transition]] = field(default_factory=list)


@dataclass(frozen=True)
class _RunResult:
    windows: int
    locked: bool
    transitions: list[Transition]


Notify = Callable[[str, Finding], None]


class AnalysisWorker:
    """Runs analysis passes on a daemon thread; :meth:`run_once` runs one synchronously."""

    def __init__(
        self,
        storage: Storage,
        config: WorkerConfig | None = None,
        *,
        notify: Notify | None = None,
        on_pass: Callable[[PassReport, float], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.storage = storage
        self.engine = storage.engine
        self.config = config or WorkerConfig()
        self._notify = notify
        self._on_pass = on_pass
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ranks = inputs.RankReads()

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="stepwatch-analysis", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            try:
                self.run_once()
            except Exception:  # the database may be away; try again next interval
                log.exception("analysis pass failed")

    # -- one pass ---------------------------------------------------------------------
    def run_once(self) -> PassReport:
        """Analyse every active run once (each as far as its complete windows go)."""
        t0 = time.perf_counter()
        now = self._clock()
        report = PassReport()
        since = datetime.fromtimestamp(now - self.config.horizon_s, timezone.utc)
        with self.engine.connect() as conn:
            runs = inputs.active_runs(conn, since)
        self._ranks.keep(r.id for r in runs)
        for run in runs:
            if self._stop.is_set():
                break
            report.runs += 1
            for _ in range(self.config.max_batches_per_run):
                try:
                    result = self._analyse(run, now)
                except StateConflictError:
                    report.conflicts += 1
                    break
                except Exception:
                    log.exception("analysis of run %s failed", run.name)
                    report.errors += 1
                    break
                report.windows += result.windows
                report.locked += result.locked
                report.transitions += [(run.name, t) for t in result.transitions]
                self._send(run.name, result.transitions)
                if result.locked or result.windows < self.config.max_windows:
                    break
        if self._on_pass is not None:
            self._on_pass(report, time.perf_counter() - t0)
        return report

    def _send(self, run: str, transitions: list[Transition]) -> None:
        if self._notify is None:
            return
        for t in transitions:
            try:
                self._notify(run, t.finding)
            except Exception:
                log.exception("webhook notify failed")

    def _analyse(self, run: RunInfo, now: float) -> _RunResult:
        cfg = self.config
        with self.engine.connect() as conn, conn.begin(), self.storage.reads_hold_no_snapshot(conn):
            if not self.storage.lock_run(conn, run.id):
                return _RunResult(0, True, [])
            stored = load_state(conn, run.id)
            analysis, source = self._analysis(conn, run, stored)
            next_window = stored.next_window if stored else 0
            ranks = self._ranks.rows(conn, run.id)
            # A provisional window size (no batch has shown the run's pace) would cut
            # windows of one step: the windows wait for the settled size, hangs do not.
            ready = ready_windows(
                next_window=next_window,
                window_steps=run.window_steps,
                world_size=run.world_size,
                ranks=[r.progress for r in ranks],
                max_step=inputs.max_step(conn, run.id),
                pending=stored.pending if stored else {},
                now=now,
                grace_s=cfg.grace_s,
                limit=0 if run.window_provisional else cfg.max_windows,
            )
            changes: list[Change] = []
            summary: list[summaries.Census | summaries.Profiled | summaries.Kind] = []
            if ready.windows:
                first, last = ready.windows[0], ready.windows[-1]
                # No snapshot held after each read (``reads_hold_no_snapshot``), so
                # none through the computation; the writes come last, so until then the
                # transaction has no id either.
                windows = inputs.rank_windows(conn, run, ranks, first, last)
                steps = inputs.job_steps(conn, run, first, last)
                timing = inputs.step_timings(conn, run, ranks, first, last)
                links = inputs.link_samples(conn, run, ranks, first, last)
                peer_of = inputs.peer_groups(ranks)
                ws = run.window_steps
                for w in ready.windows:
                    changes += analysis.feed(
                        w,
                        windows.get(w, []),
                        steps.get(w, []),
                        first_step=w * ws + 1,
                        last_step=(w + 1) * ws,
                        mfu_per_token_rate=run.mfu_per_token_rate,
                        timing=inputs.by_group(timing.get(w, []), peer_of),
                        links=links.get(w, ()),
                    )
                next_window = last + 1
                summary = self._summaries(conn, run, ranks, ready, windows)
                # Staged per-step timing is only needed until its window is analysed.
                drop_step_timings(conn, run.id, [r.rank for r in ranks], (last + 1) * ws)
            stamp = datetime.fromtimestamp(now, timezone.utc)
            # Open flags are refreshed (latest step, evidence, cost) only when windows moved.
            refresh = analysis.open_findings() if ready.windows else []
            transitions = write_findings(conn, run.id, changes, refresh, stamp)
            summaries.store(conn, self.storage.insert, run.id, summary)
            transitions += self._hangs(conn, run, ranks, now, next_window, stamp)
            transitions += captures.on_pass(conn, run, transitions, ranks, cfg.captures, stamp)
            if stored is None or ready.windows or dict(ready.pending) != dict(stored.pending):
                save_state(
                    conn,
                    run.id,
                    stored,
                    next_window=next_window,
                    state=analysis.to_state(),
                    pending=ready.pending,
                    baseline_source=source,
                    now=stamp,
                )
        if ready.by_grace:
            log.info("run %s: windows %s analysed without late ranks (grace)", run.name, ready.by_grace)
        return _RunResult(len(ready.windows), False, transitions)

    def _summaries(
        self,
        conn: Connection,
        run: RunInfo,
        ranks: Sequence[inputs.RankRow],
        ready: Readiness,
        windows: Mapping[int, Sequence[RankWindow]],
    ) -> list[summaries.Census | summaries.Profiled | summaries.Kind]:
        """What ``/metrics`` reports of the newest window analysed and of the newest
        profiled one among those, computed once here rather than at every scrape
        (:mod:`..exporter.summaries`). The census also of a window analysed by grace,
        without a late rank: the rank's steps, if they come, change its signature (a
        rank whose agent died leaves every window to the grace). The profiled summary
        not: a late rank's profiler entry changes no signature."""
        graced = set(ready.by_grace)
        ws, k = run.window_steps, self.config.summary_top
        out: list[summaries.Census | summaries.Profiled | summaries.Kind] = []
        census = summaries.census_of(conn, run.id, ready.windows[-1], ws, k)
        out.append(census or "census")
        # A profiler entry changes its window's rows without a step stored: the profiled
        # summary is final only if readiness waited for every rank's entries, which it
        # does for ranks that say through which step they sent them (an agent with a
        # profiler); an older agent's entry may still come after the analysis.
        if any(r.profiles_through is None for r in ranks):
            return out
        whole = [w for w in ready.windows if w not in graced]
        profiled = [w for w in whole if any(r.compute_s is not None for r in windows.get(w, ()))]
        if profiled and (prof := summaries.profiled_of(conn, run.id, profiled[-1], ws, k)):
            out.append(prof)
        return out

    def _analysis(
        self, conn: Connection, run: RunInfo, stored: StoredState | None
    ) -> tuple[RunAnalysis, str]:
        if stored is not None:
            return RunAnalysis.from_state(run.name, stored.state), stored.baseline_source
        baseline, source = self._baseline(conn, run)
        analysis = RunAnalysis(
            run.name,
            stragglers=self.config.stragglers,
            regressions=self.config.regressions,
            baseline=baseline,
            fingerprint=run.config_fingerprint,
        )
        return analysis, source

    def _baseline(self, conn: Connection, run: RunInfo) -> tuple[Baseline | None, str]:
        """The named baseline run's frozen baseline when the fingerprints match, else own."""
        if not run.baseline_run:
            return None, "own"
        other = find_run(conn, run.baseline_run)
        stored = None if other is None else load_state(conn, other.id)
        if other is None or stored is None:
            return None, f"own (baseline run {run.baseline_run} not found or not analysed)"
        base = RunAnalysis.from_state(other.name, stored.state).regressions.baseline
        if base is None:
            return None, f"own (baseline run {run.baseline_run} has no baseline yet)"
        if base.fingerprint != run.config_fingerprint:
            return None, (
                f"own (baseline run {run.baseline_run} has fingerprint {base.fingerprint}, "
                f"this run {run.config_fingerprint})"
            )
        return base, run.baseline_run

    def _hangs(
        self,
        conn: Connection,
        run: RunInfo,
        ranks: Sequence[inputs.RankRow],
        now: float,
        window: int,
        stamp: datetime,
    ) -> list[Transition]:
        """Open hang flags for silent ranks (or the run); close those that resolved."""
        live = [r for r in ranks if not r.progress.finished]
        current: list[Finding] = []
        if live:
            # Finished ranks are not silent: with them in, a rank that never sent its final
            # batch stays a per-rank flag instead of turning into a hang of the whole run.
            seen = {r.rank: (r.last_seen if not r.progress.finished else now) for r in ranks}
            median_step = inputs.recent_step_time(conn, run.id)
            threshold = hang_threshold_s(
                median_step, self.config.hang_k, self.config.hang_floor_s, self.config.hang_startup_s
            )
            # The counters are read only when some rank is silent past the threshold.
            silent = now - min(seen.values()) > threshold
            current = check_hang(
                now,
                seen,
                median_step,
                self.config.hang_k,
                self.config.hang_floor_s,
                run=run.name,
                host_by_rank={r.rank: r.host for r in ranks},
                last_step_by_rank={r.rank: r.last_step for r in ranks},
                collectives=inputs.group_counters(conn, run.id) if silent else (),
                live_ranks=[r.rank for r in live],
                startup_s=self.config.hang_startup_s,
            )
        stored = open_hangs(conn, run.id)
        # One stop of the run is one event: its first step is the lowest last step of
        # the ranks when it opened, and a window still on its way (a sender retrying on
        # a loaded collector) may raise that lowest step afterwards.
        opened = {f.key: f.first_step for f in stored if f.key == "hang:run"}
        current = [replace(f, first_step=opened[f.key]) if f.key in opened else f for f in current]
        ids = {(f.key, f.first_step) for f in current}
        closing = [
            Change(replace(f, run=run.name, status="closed", message="Resolved: " + f.message), window)
            for f in stored
            if (f.key, f.first_step) not in ids
        ]
        if not current and not closing:
            return []
        return write_findings(conn, run.id, closing, current, stamp)
