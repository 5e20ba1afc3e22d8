"""The profiler window: a few steps under ``torch.profiler`` every N steps, within a budget.

Schedule (deterministic in the step number, so every rank profiles the same steps):
a window starts at the end of step ``s`` when ``s`` is a multiple of the period ``every``
(and past warm-up), profiles steps ``s+1 .. s+k`` (``k = profile_steps``) and stops at the
end of step ``s+k``. The agent's hot path only compares its step number with the next
*edge* returned here (one integer compare per step); ``torch.profiler`` is started,
stepped and stopped only on edge steps.

Off the training thread: exporting the trace, parsing it, NVML and the cost bookkeeping
run on the ``stepwatch-profiler`` daemon thread; finished entries wait in a bounded
deque that the sender drains into the next payload that holds their steps, and each
payload says through which step the rank owes no entry (``steps.profiles_through``).

Self-measured cost of a window (seconds), all of it counted against the budget:

* on the training thread: ``start()`` + ``step()`` calls + ``stop()`` (``stop`` is the
  big one: Kineto collects its buffers; on CUDA torch also synchronises the device once
  here, the only device sync stepwatch causes, once per window, never in ``sw.step``);
* the slowdown of the profiled steps themselves: their time minus ``k`` times the median
  of the steps just before the window (minus the start/step calls already counted);
* the profiler thread's CPU time for export and parse (it competes for the GIL and for
  cores with training);
* the *lasting* slowdown: after ``torch.profiler`` stops, CUPTI can stay attached and slow
  every later step by 10-20% (pytorch #144455, kineto #1264), which a comparison with the
  steps just before a window cannot see. So each window also compares the median of the
  steps just before it (the furthest from the previous window) with the median of the
  steps before the *first* window; an excess above :data:`LASTING_NOISE` of the latter is
  paid by every unprofiled step of the period and counted as ``lasting_s``. Since it
  does not shrink with a longer period, it stretches the period to its cap, and the
  entry's cost names it. Only on CUDA ranks: a CPU rank has no CUPTI to stay attached,
  and there the comparison reads the host's own drift instead (on the 2-core VM of
  ``benchmarks.agent_overhead``, more than 3% within minutes): charged to every step of
  the period, it grew with the period it stretched, up to 3.8 s of a 4.0 s estimate
  against 0.3-0.4 s measured, and cost coverage (windows 16x apart), not speed.

Where torch offers it, CUPTI is released after each window: on CUDA >= 12.6 the agent
sets ``TEARDOWN_CUPTI=1`` (Kineto then calls ``cuptiFinalize`` when a window ends) unless
the variable is already set, by the user or by torch itself (torch sets it to 0 when CUDA
graphs are in use on older CUDA, where teardown crashes). It is set once, at ``init``.
Measured on an H200 (torch 2.11, CUDA 13.0, a step of 200 small kernels): +31.5% to
+32.3% per step after a session without teardown, -2.4% to +2.7% with it. Teardown has
a catch there: a session started right after another one stopped recorded no kernel
(three back to back: 12, 0, 12 kernels; 0.5 s of work apart: all 12), as did the agent's
first window after a session of the script's own. Such a window on a CUDA rank is
reported skipped (:data:`NO_DEVICE_ACTIVITY`), never parsed as a CPU rank's.

A trace over :data:`stepwatch.profiler.chrome.MAX_TRACE_BYTES` is not parsed: the window
is skipped and says so, and its export cost still counts.

Budget: the period is stretched to the smallest ``base * 2**j`` for which the median
cost of the last four windows is at most ``budget`` (default 1%) of ``period x median
step time``; checked after each window, and once before the first one against a prior
of :data:`PRIOR_COST_S` (so fast steps, where 100 steps are a few seconds, do not pay
more than the budget for the first windows either). Powers of two keep ranks aligned: a rank with a longer
period profiles a subset of the windows of a rank with a shorter one, so the collector
still finds every rank in the windows that all of them profiled.

One-time cost: the first ``start()`` of ``torch.profiler`` in a process imports
``torch._inductor`` (via ``hasattr(torch, "_inductor")``, about 1 s of CPU here).
:meth:`ProfilerWindow.warm` does that import on the profiler thread at ``init``, so it
lands in the warm-up steps (kept out of baselines) instead of stalling the training
thread at the first window; on interpreters whose AST constructor is not thread-safe
(:data:`AST_THREAD_SAFE`) it is done inside ``init`` instead.

A window is skipped (and the skip is reported in the payload) when another profiler is
active in the process (CUPTI allows one subscriber), when the previous window is still
being parsed, or when the profiler fails to start.

Captures (asked for by the collector, ``stepwatch._steering``): one window over steps
``S .. S+K-1`` chosen by the collector for several ranks at once, scheduled with
:meth:`ProfilerWindow.request_capture` on the training thread. It takes precedence over a
periodic window that would overlap it, runs even with the periodic window off
(``every=0``), and its entry carries ``capture`` (the directive's id) with its measured
cost; it is not counted in the periodic budget (a person or a flag asked for it, and the
collector bounds its length), and a capture that cannot start is reported as skipped
with the reason, like a window.

Why more than 400 lines: one class, because the schedule, the cost accounting and the
budget stretch read and write the same window state from two threads; the cost model
above is most of its length.
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import sys
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from .. import wire
from .._clock_sync import ClockSync
from .._nvml import Nvml
from ._entry import build_entry
from .chrome import MAX_TRACE_BYTES, trace_from_profiler
from .trace import DATA_WAIT_SPAN

log = logging.getLogger("stepwatch")
_perf = time.perf_counter

NEVER = 1 << 62
MAX_STRETCH = 1024
BASELINE_STEPS = 32
MAX_PENDING = 8
#: Seconds after a window stopped that its entry is no longer claimed as owed (see
#: :meth:`ProfilerWindow.owed`): a profiler thread stuck in an export must not hold the
#: collector's analysis of every later window back to its grace period.
OWED_GIVE_UP_S = 60.0
MAX_STEPS = wire.MAX_CAPTURE_STEPS
#: Captures one process holds scheduled at once.
MAX_CAPTURES = 4
PRIOR_COST_S = 0.1
"""Assumed cost of a window before one is measured (measured here: 50-100 ms on a small
CPU model; pushed out of the median by the first measured windows)."""
LASTING_NOISE = 0.03
"""Step-time excess over the steps before the first window that is taken for noise (a
lasting CUPTI slowdown is 10-20%; step times of a steady run vary by a few percent)."""
NO_DEVICE_ACTIVITY = "no device activity in the trace (CUPTI recorded no kernel)"
"""Why a CUDA rank's window whose trace holds no GPU work is skipped."""
TEARDOWN_FROM_CUDA = (12, 6)
"""First CUDA version on which Kineto's CUPTI teardown is reliable (kineto #1264)."""
AST_THREAD_SAFE = sys.version_info >= (3, 12, 2) or (3, 11, 8) <= sys.version_info < (3, 12)
"""Whether two threads may build ASTs at once. CPython 3.10-3.11.7 and 3.12.0-3.12.1 keep
the AST constructor's recursion depth in interpreter-wide state (cpython gh-106905, fixed
in 3.11.8 and 3.12.2): while one thread imports ``torch._inductor`` (dozens of
``inspect.signature`` calls, each an ``ast.parse``), another thread's ``ast.parse`` can
raise ``SystemError: AST constructor recursion depth mismatch``."""


def release_cupti_after_windows(environ: MutableMapping[str, str], cuda_version: str | None) -> bool:
    """Ask Kineto to detach CUPTI when a window stops (see the module docstring).

    Returns whether teardown is on. A value already in ``environ`` is left alone.
    """
    if "TEARDOWN_CUPTI" in environ:
        return environ["TEARDOWN_CUPTI"] == "1"
    try:
        version = tuple(int(x) for x in (cuda_version or "").split(".")[:2])
    except ValueError:
        return False
    if len(version) < 2 or version < TEARDOWN_FROM_CUDA:
        return False
    environ["TEARDOWN_CUPTI"] = "1"
    return True


def _torch_cuda_version() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    v = getattr(torch.version, "cuda", None)
    return v if isinstance(v, str) else None


@dataclass
class _Job:
    prof: Any
    first_step: int
    n_steps: int
    every: int
    times: list[float]
    baseline: list[float]
    start_s: float
    calls_s: float
    stop_s: float
    extra: dict[str, Any] = field(default_factory=dict)
    capture: str | None = None
    #: Keep the capture's raw trace, gzipped, when at most this many bytes (0: do not).
    keep_trace: int = 0


def _other_profiler_active() -> bool:
    from torch.autograd import profiler as autograd_profiler

    return bool(autograd_profiler._is_profiler_enabled)


class ProfilerWindow:
    """Drives ``torch.profiler`` from the agent's edges; see the module docstring."""

    def __init__(
        self,
        *,
        every: int,
        steps: int,
        budget: float,
        warmup_end: int,
        cuda: bool = False,
        record_shapes: bool | None = None,
        clock_sync: ClockSync | None = None,
        nvml: Nvml | None = None,
        make_profiler: Callable[[], Any] | None = None,
        other_profiler_active: Callable[[], bool] = _other_profiler_active,
        max_trace_bytes: int = MAX_TRACE_BYTES,
    ) -> None:
        if every < 0 or every == 1 or not 1 <= steps <= MAX_STEPS or (every and steps >= every):
            raise ValueError(
                f"need profile_every 0 (off) or 1 <= profile_steps < profile_every, got {steps} and {every}"
            )
        self.base = every
        #: The budget's stretch of the period (a power of two), written by the profiler
        #: thread after each window; the period in force is ``base * _mult`` (:attr:`every`),
        #: so a new base set live on the training thread is never overwritten by a period
        #: the profiler thread computed from the old one.
        self._mult = 1
        self.k = steps
        self.budget = budget
        self.warmup_end = warmup_end
        self.cuda = cuda
        # Shapes give gloo collectives their byte counts but make stop() ~5x slower on
        # CPU; on CUDA the NCCL metadata needs them and steps are long.
        self.record_shapes = cuda if record_shapes is None else record_shapes
        self.clock_sync = clock_sync
        self.nvml = nvml
        self.max_trace_bytes = max_trace_bytes
        self._make = make_profiler or self._torch_profiler
        self._other_active = other_profiler_active
        #: True while a window records; the loader wrapper then emits data-wait spans.
        self.active = False
        #: First step of the window whose entry the sender has not been handed yet (it
        #: records, or the profiler thread parses it), else None: the collector waits for
        #: that entry before it compares the window's ranks (:meth:`take_through`). Written by the
        #: training thread at a start and by whichever thread pushes the window's entry,
        #: never by both at once (a start needs the profiler thread idle).
        self.owed_from: int | None = None
        #: When the owed window stopped (``perf_counter``; 0.0 while it records).
        self._owed_stopped = 0.0
        self.record_function: Any = None
        self._prof: Any = None
        self._first = 0
        self._every_used = every
        self._k_used = steps
        #: Captures scheduled by ``request_capture``, in step order: (first step, steps, id).
        self._captures: list[tuple[int, int, str]] = []
        #: Raw-trace caps of the scheduled captures that asked this rank for its trace.
        self._keep: dict[str, int] = {}
        #: (capture id, gzipped trace) for the sender to upload (profiler thread appends).
        self.traces: deque[tuple[str, bytes]] = deque(maxlen=2)
        self._capture_id: str | None = None
        self.captures = 0
        self.last_capture_cost: dict[str, Any] | None = None
        self._times: list[float] = []
        self._baseline: list[float] = []
        self._start_s = 0.0
        self._calls_s = 0.0
        self._idle = threading.Event()  # set while no window waits for the profiler thread
        self._idle.set()
        # The cost estimate starts from a prior, so that even the first window respects the
        # budget: the period is checked against it at the first start (see ``_start``).
        self._costs: deque[float] = deque([PRIOR_COST_S], maxlen=4)
        self._checked_prior = False
        self.results: deque[dict[str, Any]] = deque()
        self.windows = 0
        self.skipped = 0
        self.dropped = 0
        self.last_cost: dict[str, Any] | None = None
        #: (first step, period it ran under) of the latest windows (stats and benchmarks).
        self.recent: deque[tuple[int, int]] = deque(maxlen=16)
        self._jobs: deque[_Job] = deque()
        self._warm_pending = False
        #: CPU seconds of the one-time imports done by :meth:`warm`.
        self.warm_cpu_s: float | None = None
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        #: Median step time before the first window: the reference for lasting slowdowns.
        self.before_first_s: float | None = None
        #: Whether Kineto was asked to detach CUPTI after each window (CUDA only).
        self.cupti_teardown = (
            release_cupti_after_windows(os.environ, _torch_cuda_version())
            if cuda and make_profiler is None
            else False
        )

    # -- schedule ------------------------------------------------------------------
    def next_start(self, after: int) -> int:
        """The first step ``s > after`` (and past warm-up) that starts a window, or the
        start edge of a scheduled capture if that comes first."""
        every = self.every
        periodic = (max(after, self.warmup_end) // every + 1) * every if every else NEVER
        for c in self._captures:
            if c[0] - 1 > after:
                return min(periodic, c[0] - 1)
        return periodic

    def request_capture(
        self, first_step: int, steps: int, ident: str, done: int, *, keep_trace: int = 0
    ) -> str | None:
        """Schedule a capture of ``first_step .. first_step + steps - 1`` (training thread,
        ``done`` = the last finished step; ``keep_trace``: keep the raw trace, gzipped, up
        to that many bytes). Returns why it cannot be, else None; the caller then takes
        :meth:`next_start` as its next edge unless a window records."""
        if not 1 <= steps <= MAX_STEPS:
            return f"steps={steps} is outside [1, {MAX_STEPS}]"
        self._captures = [c for c in self._captures if c[0] - 1 > done]  # passed without a start edge
        if len(self._captures) >= MAX_CAPTURES:
            return f"{MAX_CAPTURES} captures are already scheduled"
        if first_step - 1 <= done or (self.active and first_step - 1 <= self._first + self._k_used - 1):
            return f"too late: applied after step {done}, the capture starts at step {first_step}"
        for f, k, other in self._captures:  # one window at a time: [S, S+K) and the edge before it
            if first_step - 1 <= f + k - 1 and f - 1 <= first_step + steps - 1:
                return f"overlaps capture {other} (steps {f}-{f + k - 1})"
        self._captures = sorted([*self._captures, (first_step, steps, ident)])
        if keep_trace > 0:
            self._keep[ident] = keep_trace
        return None

    def reconfigure(self, every: int, steps: int) -> str | None:
        """A new period and window length (a live setting; training thread). The period
        is then stretched again by the budget from the new base."""
        if every < 0 or every == 1 or not 1 <= steps <= MAX_STEPS or (every and steps >= every):
            return (
                f"need profile_every 0 (off) or 1 <= profile_steps < profile_every, got {steps} and {every}"
            )
        self.base = every
        self._mult = 1
        self.k = steps
        return None

    @property
    def every(self) -> int:
        """The period in force: the base stretched by the budget (0: periodic window off)."""
        return self.base * self._mult

    # -- training thread -----------------------------------------------------------
    def edge(self, step: int, times: array[float], n: int) -> int:
        """Called by ``sw.step`` at the end of ``step`` when it equals the last returned
        edge. ``times[:n]`` are the agent's step times, this step's last. Returns the
        next edge. Never raises: a failure skips the window."""
        try:
            if not self.active:
                return self._start(step, times, n)
            self._times.append(times[n - 1])
            if step >= self._first + self._k_used - 1:
                return self._stop(step)
            t0 = _perf()
            self._prof.step()
            self._calls_s += _perf() - t0
            return step + 1
        except Exception as exc:
            self._abandon(step, f"profiler error: {exc!r}")
            return self.next_start(step)

    def _start(self, step: int, times: array[float], n: int) -> int:
        c = self._captures[0] if self._captures else None
        capture = c is not None and step == c[0] - 1
        if not capture:
            if (
                not self._checked_prior and n and self.base
            ):  # before the first window: the prior vs the budget
                self._checked_prior = True
                self._mult = self._stretch(statistics.median(times[max(0, n - BASELINE_STEPS) : n]))
            every = self.every
            if not every or step % every or step <= self.warmup_end:  # the period changed since scheduling
                return self.next_start(step)
            if c is not None and step + self.k >= c[0] - 1:  # it would overlap the capture
                return self.next_start(step)
            k, ident = self.k, None
        else:
            assert c is not None
            self._captures.pop(0)
            every, k, ident = 0, c[1], c[2]
        # Named before anything can fail, so that a skip reports the capture it skips.
        self._capture_id = ident
        reason = None
        if not self._idle.is_set():
            reason = "previous window still being parsed"
        elif self._other_active():
            reason = "another profiler active"
        if reason is not None:
            self._skip(step + 1, reason, ident)
            return self.next_start(step)
        if self.clock_sync is not None:
            self.clock_sync.start()
        t0 = _perf()
        prof = self._make()
        prof.step_num = step + 1  # ProfilerStep#N carries the real step number
        prof.start()
        self._start_s = _perf() - t0
        self._prof = prof
        self._first = step + 1
        self._every_used = every
        self._k_used = k
        self._capture_id = ident
        self._times = []
        self._calls_s = 0.0
        self._baseline = list(times[max(0, n - BASELINE_STEPS) : n])
        if self.before_first_s is None and self._baseline:
            self.before_first_s = statistics.median(self._baseline)
        from torch.profiler import record_function

        self.record_function = record_function
        self._owed_stopped = 0.0
        self.owed_from = step + 1
        self.active = True
        return step + 1

    def _stop(self, step: int) -> int:
        prof = self._prof
        self.active = False
        self.record_function = None
        self._prof = None
        t0 = _perf()
        prof.stop()
        stop_s = _perf() - t0
        self._owed_stopped = t0
        self._idle.clear()
        self._jobs.append(
            _Job(
                prof=prof,
                first_step=self._first,
                n_steps=len(self._times),
                every=self._every_used,
                times=self._times,
                baseline=self._baseline,
                start_s=self._start_s,
                calls_s=self._calls_s,
                stop_s=stop_s,
                capture=self._capture_id,
                keep_trace=self._keep.pop(self._capture_id, 0) if self._capture_id else 0,
            )
        )
        self._ensure_thread()
        self._wake.set()
        return self.next_start(step)

    def _abandon(self, step: int, reason: str) -> None:
        prof, self._prof = self._prof, None
        self.active = False
        self.record_function = None
        if prof is not None:
            with contextlib.suppress(Exception):
                prof.stop()
        self._skip(self._first if prof is not None else step + 1, reason, self._capture_id)
        self.owed_from = None  # after the push: the sender reads it before it takes

    def _skip(self, first_step: int, reason: str, capture: str | None = None) -> None:
        self.skipped += 1
        entry: dict[str, Any] = {"first_step": first_step, "n_steps": 0, "skipped": reason[:128]}
        if capture is not None:
            entry["capture"] = capture
        self._push(entry)

    def _push(self, entry: dict[str, Any]) -> None:
        while len(self.results) >= MAX_PENDING:
            try:
                self.results.popleft()
            except IndexError:
                break
            self.dropped += 1
        self.results.append(entry)

    @property
    def idle(self) -> bool:
        """No finished window is waiting for (or being processed by) the profiler thread."""
        return self._idle.is_set()

    def drain(self, timeout_s: float) -> bool:
        """Stop a window in progress (its steps are cut short) and wait up to
        ``timeout_s`` for the profiler thread to finish. True when nothing is left."""
        if self.active:
            if self._times:
                self._abandon(self._first, "agent closed during the window")
            else:  # started on the last step: nothing was profiled, nothing to report
                prof, self._prof = self._prof, None
                self.active = False
                self.record_function = None
                with contextlib.suppress(Exception):
                    prof.stop()
                if self._capture_id is not None:
                    self._skip(self._first, "agent closed at the capture's first step", self._capture_id)
                self.owed_from = None
        return self._idle.wait(timeout_s)

    def stats(self) -> dict[str, Any]:
        """Windows done, skipped and dropped, the period in force and the last cost."""
        return {
            "windows": self.windows,
            "skipped": self.skipped,
            "dropped": self.dropped,
            "every": self.every,
            "last_cost": self.last_cost,
            "recent_windows": list(self.recent),
            "warm_cpu_s": self.warm_cpu_s,
            "before_first_s": self.before_first_s,
            "cupti_teardown": self.cupti_teardown,
            "captures": self.captures,
            "last_capture_cost": self.last_capture_cost,
        }

    def take(self) -> list[dict[str, Any]]:
        """All finished entries, in step order (sender thread)."""
        return self.take_through(None)[0]

    def take_through(self, through: int | None) -> tuple[list[dict[str, Any]], int]:
        """The finished entries of windows whose steps all lie at or before step
        ``through`` (all entries: None), in step order, and the step through which this
        rank then owes no entry (sender thread). A later window's entry waits for a batch
        that carries its last step: a sender behind the training thread would otherwise
        deliver a breakdown before the rank windows it belongs to exist, and the
        collector updates only rows it has.

        "Owes no entry": every window starting at or before that step has had its entry
        taken, now or earlier, or lost (dropped past :data:`MAX_PENDING`). The owed window
        is read *before* the entries are taken, so an entry pushed in between is taken
        here or counted as owed, never neither."""
        owed = self.owed()
        out: list[dict[str, Any]] = []
        later: list[dict[str, Any]] = []
        while True:
            try:
                entry = self.results.popleft()
            except IndexError:
                break
            # Not in step order: a skip is pushed at once, a parsed window when it is done.
            end = int(entry["first_step"]) + max(int(entry["n_steps"]), 1) - 1
            (later if through is not None and end > through else out).append(entry)
        self.results.extendleft(reversed(later))  # ahead of anything pushed meanwhile
        out.sort(key=lambda e: int(e["first_step"]))
        held = [int(e["first_step"]) for e in later] + ([owed] if owed is not None else [])
        limit = NEVER if through is None else through
        return out, max(0, min([limit, *(f - 1 for f in held)]))

    def owed(self) -> int | None:
        """First step of the window whose entry is still to come (:attr:`owed_from`),
        unless it stopped more than :data:`OWED_GIVE_UP_S` ago: then the profiler thread
        is stuck, and the collector had better compare the windows without it."""
        owed, stopped = self.owed_from, self._owed_stopped
        if owed is not None and stopped and _perf() - stopped > OWED_GIVE_UP_S:
            return None
        return owed

    # -- profiler thread -----------------------------------------------------------
    def _torch_profiler(self) -> Any:
        from torch.profiler import ProfilerAction, ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.cuda:
            activities.append(ProfilerActivity.CUDA)
        # A schedule that always records makes torch emit the ProfilerStep#N spans.
        return profile(
            activities=activities,
            record_shapes=self.record_shapes,
            schedule=lambda _step: ProfilerAction.RECORD,
        )

    def _ensure_thread(self) -> None:
        if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
            self._pid = os.getpid()
            self._thread = threading.Thread(target=self._run, name="stepwatch-profiler", daemon=True)
            self._thread.start()

    def warm(self, *, background_only: bool = False) -> None:
        """Pay torch.profiler's one-time imports now: on the profiler thread (at ``init``;
        or from the sender thread when a capture is asked for and nothing paid them yet).
        Once: a second call while the first is pending does nothing.

        Where the interpreter cannot build ASTs on two threads at once
        (:data:`AST_THREAD_SAFE`), the imports run on the calling thread instead (``init``,
        before training starts), or not at all with ``background_only`` (then a capture's
        first window pays them, in its measured cost): a background import could make the
        training thread's own ``ast.parse`` (``torch.compile``, ``inspect.signature``) raise
        ``SystemError``."""
        if self._warm_pending or self.warm_cpu_s is not None:
            return
        if not AST_THREAD_SAFE:
            if not background_only:
                self._warm()
            return
        self._warm_pending = True
        self._ensure_thread()
        self._wake.set()

    def _warm(self) -> None:
        self._warm_pending = False
        c0 = time.thread_time()
        try:
            import torch
            import torch.profiler

            hasattr(torch, "_inductor")  # what torch.profiler's prepare_trace triggers
        except Exception:  # a broken optional import must not kill the thread
            pass
        self.warm_cpu_s = time.thread_time() - c0

    def _run(self) -> None:
        while True:
            if self._warm_pending:
                self._warm()
            self._wake.wait()
            self._wake.clear()
            while True:
                try:
                    job = self._jobs.popleft()
                except IndexError:
                    break
                try:
                    self._push(self.process(job))
                except Exception as exc:  # never let the thread die
                    log.warning("stepwatch: profiler window dropped: %r", exc)
                finally:
                    # After the push, before a new window may start (that needs idle).
                    self.owed_from = None
                    self._idle.set()
                    if self._jobs:  # appended meanwhile: not idle after all
                        self._idle.clear()

    def process(self, job: _Job) -> dict[str, Any]:
        """Export and parse one finished window, account its cost, stretch the period."""
        c0 = time.thread_time()
        kept: list[bytes] | None = [] if job.keep_trace else None
        try:
            trace = trace_from_profiler(
                job.prof, max_bytes=self.max_trace_bytes, keep=kept, keep_max=job.keep_trace
            )
            job.prof = None
            entry = build_entry(trace, first_step=job.first_step, n_steps=job.n_steps)
            del trace
            if self.cuda and entry.get("device") != "cuda":
                # CUPTI recorded nothing on the device: a breakdown of the host ops alone
                # would read as a CPU rank's. Seen on an H200 (torch 2.11, CUDA 13.0) with
                # TEARDOWN_CUPTI=1: a session started right after another one stopped held
                # no kernel. Its cost counts, as a window's (as for a trace over the cap).
                entry = {"first_step": job.first_step, "n_steps": 0, "skipped": NO_DEVICE_ACTIVITY}
        except Exception as exc:
            job.prof = None
            entry = {"first_step": job.first_step, "n_steps": 0, "skipped": f"parse failed: {exc!r}"[:128]}
        parse_s = time.thread_time() - c0
        base_step = statistics.median(job.baseline) if job.baseline else None
        on_thread = job.start_s + job.calls_s + job.stop_s
        slowdown = 0.0
        if base_step is not None and job.times:
            slowdown = max(0.0, sum(job.times) - len(job.times) * base_step - job.start_s - job.calls_s)
        lasting = 0.0
        lasting_ratio = None
        ref = self.before_first_s
        # The first window's baseline is ref; a CPU rank has no CUPTI (module docstring).
        if self.cuda and ref and base_step is not None and self.windows > 0:
            lasting_ratio = max(0.0, base_step / ref - 1.0)
            if lasting_ratio > LASTING_NOISE:
                lasting = (base_step - ref) * max(0, job.every - job.n_steps)
        if job.capture is not None:  # asked for: its cost is reported, not budgeted
            lasting, lasting_ratio = 0.0, None
        total = on_thread + slowdown + parse_s + lasting
        if job.capture is None:
            self._costs.append(total)
            self._mult = self._stretch(base_step)
            self.windows += 1
            self.recent.append((job.first_step, job.every))
        else:
            self.captures += 1
        cost = {
            "window_s": total,
            "on_thread_s": on_thread,
            "slowdown_s": slowdown,
            "parse_cpu_s": parse_s,
            "lasting_s": lasting,
            "lasting_ratio": lasting_ratio,
            "every": job.every,
            "next_every": self.every,
            "overhead_ratio": total / (job.every * base_step) if base_step and job.every else None,
        }
        if job.capture is None:
            self.last_cost = cost
        else:
            self.last_capture_cost = cost
            entry["capture"] = job.capture
            if kept:  # the raw trace asked for: uploaded by the sender, apart from the batch
                self.traces.append((job.capture, kept[0]))
        entry["cost"] = cost
        cs = self.clock_sync
        entry["clock"] = cs.estimate.to_dict() if cs is not None and cs.estimate is not None else None
        entry["nvml"] = self.nvml.sample() if self.nvml is not None else None
        return entry

    def _stretch(self, step_s: float | None) -> int:
        """The stretch (a power of two) that keeps the median window cost within budget."""
        base = self.base
        if not base or not step_s or step_s <= 0 or self.budget <= 0 or not self._costs:
            return self._mult
        return stretch(base, statistics.median(self._costs), self.budget, step_s)


def stretch(base: int, cost_s: float, budget: float, step_s: float) -> int:
    """The smallest power of two (at most :data:`MAX_STRETCH`) by which a period of
    ``base`` steps of ``step_s`` must grow for a window costing ``cost_s`` to stay within
    ``budget`` of it (benchmarks size their runs by the same rule)."""
    need = cost_s / (budget * step_s)
    mult = 1
    while base * mult < need and mult < MAX_STRETCH:
        mult *= 2
    return mult


__all__ = ["DATA_WAIT_SPAN", "NEVER", "ProfilerWindow", "stretch"]
