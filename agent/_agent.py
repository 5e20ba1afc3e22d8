"""The per-process agent: the hot path and the window hand-off.

``step()`` is called once per optimizer step on the training thread. It reads one
clock, stores a few numbers into preallocated arrays and, once per window, copies them
into a ``Window`` for the sender. It takes no lock, does no I/O, never synchronises a
device and never raises: any internal error disables the agent with one warning.

Longer than the usual module: the hot path, the window hand-off and the sender-side
encoding (payload, heartbeats) all read the same preallocated slots and counters, which
stay private to this class rather than becoming an interface between modules.
"""

from __future__ import annotations

import atexit
import logging
import operator
import time
import urllib.parse
import warnings
from array import array
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

from . import __version__, _collectives, wire
from ._comm_timing import CommTiming, comm_hook, count_buffer_broadcast
from ._ddp_timing import time_reduction
from ._device_clock import Boundaries, CudaEventClock
from ._env import RankInfo
from ._links import LinkSampler
from ._payload import build_payload, encode, new_batch_id
from ._sched import RunQueueClock
from ._sender import Sender, SenderStats, WindowSink
from ._steering import Steering
from ._window import Window
from .config import AgentConfig
from .profiler._window import DATA_WAIT_SPAN, NEVER, ProfilerWindow
from .wire import TAG_CODES, StepClock

log = logging.getLogger("stepwatch")
T = TypeVar("T")
_perf = time.perf_counter
#: ``_close_at`` of an agent that is off: every step is then past its window's end.
_OFF = float("-inf")
#: Padded-token slot no step wrote (counts are >= 0).
_UNSET = -1
#: Send intervals without a window after which the sender sends a heartbeat (and again
#: as often while none closes): sooner than any hang threshold the collector uses (its
#: floor is several send intervals), later than a window that is merely a step late.
HEARTBEAT_INTERVALS = 1.5


def _url_ports(url: str) -> tuple[int, ...]:
    """The collector's port (its connections are not links of the job)."""
    try:
        parsed = urllib.parse.urlsplit(url)
        return (parsed.port or (443 if parsed.scheme == "https" else 80),)
    except ValueError:
        return ()


class Stepwatch:
    """Handle returned by :func:`stepwatch.init`. See the README for the one-line hook."""

    def __init__(
        self,
        config: AgentConfig,
        rank: RankInfo,
        *,
        convention: Mapping[str, Any] | None,
        start_step: int = 0,
        device_clock: CudaEventClock | None = None,
        sender: WindowSink | None = None,
        plan: Mapping[str, Any] | None = None,
        profiler: ProfilerWindow | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.convention = convention
        #: Run-level plan (target tokens, deadline, fingerprint, baseline run), sent with
        #: every batch so that any collector replica can store it.
        self.plan = dict(plan) if plan else None
        cap = config.max_window_steps
        self._cap = cap
        self._interval = config.send_interval_s
        # Preallocated columns: the hot path only overwrites slots.
        self._time = array("d", bytes(8 * cap))
        self._wait = array("d", bytes(8 * cap))
        self._tokens = array("q", bytes(8 * cap))
        self._padded = array("q", bytes(8 * cap))
        self._tags = array("b", bytes(cap))
        self._n = 0
        # Slots no step wrote: a window whose padded counts are all unset sends none.
        self._unset = array("q", [_UNSET]) * cap
        self._padded[:] = self._unset
        # Tags (``mark()``) and data-loader waits (``loader()``, ``add_data_wait()``) are
        # written into the slot of the step in progress, so ``step()`` need not move them.
        self._no_tags = array("b", bytes(cap))
        self._no_wait = array("d", bytes(8 * cap))
        self._first_step = start_step + 1  # steps are numbered from 1 after start_step
        self._start_step = start_step
        self._warmup_end = start_step + config.warmup_steps  # last warm-up step, inclusive
        now = _perf()
        self._last = now
        self._window_start = now
        self._close_at = now + self._interval
        #: Wall time of the last closed window (a heartbeat's ``wall_end``).
        self._last_wall_end = time.time()
        # Self-timing: the common step is timed one in 64 (a second clock read per
        # step was a quarter of its cost); edge and closing steps every time.
        self._hot_s = 0.0
        self._hot_n = 0
        self._rare_s = 0.0
        self._rare_n = 0
        self._dev = device_clock
        #: Always-on collective timing, filled by the communication hook (``watch``).
        self.comm_timing = CommTiming(cap, self._position)
        #: Per-connection link timing (TCP_INFO), sampled with each timed window.
        self._links = LinkSampler(exclude_ports=_url_ports(config.url))
        #: The training thread's run-queue wait, read at each window close (``_sched``):
        #: tells a rank that waited for a core from one that stalled.
        self._runq = RunQueueClock()
        # Profiler window: the hot path compares its slot with the next edge's slot only.
        self._pw = profiler
        self._prof_at = profiler.next_start(start_step) if profiler is not None else NEVER
        self._event_i = self._next_event()
        self._enabled = config.enabled
        if not self._enabled:
            self._close_at = _OFF
        #: The collector's directives (captures, live settings), applied at window close.
        self._steering = Steering()
        self._closed = False
        self._rank_dict = rank.to_dict()
        window_bytes = Window(0, self._time, self._wait, self._tokens, self._padded, self._tags, 0.0)
        max_windows = max(4, config.max_buffer_bytes // window_bytes.approx_bytes())
        if sender is None:
            sender = Sender(
                config.url,
                self._encode,
                token=config.token,
                max_windows=max_windows,
                max_bytes=config.max_buffer_bytes,  # the collective timing makes windows larger
                timeout_s=config.http_timeout_s,
                max_attempts=config.max_attempts,
                label=f"rank {rank.rank}",
                heartbeat=self._heartbeat,
                heartbeat_s=HEARTBEAT_INTERVALS * self._interval,
                on_answer=self._on_answer,
                host_batch=config.host_batch,
            )
            if self._enabled:  # here, not on the training thread at the first window close
                sender.start()
        self._sender = sender
        atexit.register(self._atexit)

    # -- hot path ------------------------------------------------------------------
    def step(self, tokens: int = 0, padded_tokens: int | None = None) -> None:
        """Mark the end of one optimizer step that consumed ``tokens`` non-padding tokens.

        Pass plain Python ints: converting a CUDA tensor to a number synchronises the GPU.
        """
        now = _perf()
        try:
            i = self._n
            self._time[i] = now - self._last
            self._last = now
            try:
                self._tokens[i] = tokens
            except TypeError:
                self._tokens[i] = _as_count(tokens, "tokens")
            if padded_tokens is not None:
                try:
                    self._padded[i] = padded_tokens
                except TypeError:
                    self._padded[i] = _as_count(padded_tokens, "padded_tokens")
            if self._dev is not None:
                self._dev.record(i)
            i += 1
            self._n = i
            # An edge, a full or a due window; and every step once the agent is off.
            if i == self._event_i or now >= self._close_at:
                self._rare_step(i, now)
            elif i & 63 == 1:  # one common step in 64 times itself: slots 1, 65, 129 ...
                self._hot_s += _perf() - now
                self._hot_n += 1
        except Exception as exc:
            self._disable(exc)

    def _rare_step(self, i: int, now: float) -> None:
        """The tail of a step that meets a profiler-window edge or closes a window: timed
        every time (without the profiler's own calls, counted as its cost). A disabled or
        closed agent sets ``_close_at`` to minus infinity so that every step lands here and
        records nothing: the common path need not test whether the agent is on."""
        if not self._enabled:
            self._n = i - 1
            return
        edge_s = 0.0
        if i == self._event_i and self._first_step + i - 1 == self._prof_at:
            t_edge = _perf()
            self._prof_at = self._pw.edge(self._prof_at, self._time, i)  # type: ignore[union-attr]
            edge_s = _perf() - t_edge
            self._event_i = self._next_event()
        if i == self._cap or (now >= self._close_at and self._may_close(now)):
            self._close_window(now)
        self._rare_s += _perf() - now - edge_s
        self._rare_n += 1

    def _next_event(self) -> int:
        """The slot count at which the next step needs the rare path: the window is full
        or the profiler's next edge is reached."""
        edge = self._prof_at - self._first_step + 1
        return edge if self._n < edge < self._cap else self._cap

    def hot_path_mean_s(self) -> float | None:
        """Mean cost of ``step()``: the sampled common steps' mean for every common step,
        plus every rare step's own time."""
        steps = self._first_step - 1 + self._n - self._start_step
        common = steps - self._rare_n
        if self._hot_n:
            return (self._hot_s / self._hot_n * common + self._rare_s) / steps
        return self._rare_s / self._rare_n if self._rare_n else None

    def _position(self) -> tuple[int, int]:
        """(first step of the open window, slot of the step in progress), for the hook."""
        return self._first_step, self._n

    def _may_close(self, now: float) -> bool:
        """A due window waits (up to one more interval) while a profiler window is being
        parsed, so that the entry rides on the batch of the steps it profiled; at the last
        step, ``close()`` waits for it and then sends that window."""
        pw = self._pw
        return pw is None or pw.idle or now - self._window_start >= 2 * self._interval

    def _close_window(self, now: float, final: bool = False) -> None:
        n = self._n
        first = self._first_step
        tags = self._tags[:n]
        for j in range(max(0, min(n, self._warmup_end - first + 1))):
            if not tags[j]:
                tags[j] = TAG_CODES["warmup"]
        wait = self._wait[:n]
        # A tag or wait already charged to the step in progress (flush() between the
        # loader and step()) moves with it to the next window's first slot.
        tag_next, wait_next = (self._tags[n], self._wait[n]) if n < self._cap else (0, 0.0)
        m = min(n + 1, self._cap)
        self._tags[:m] = self._no_tags[:m]
        self._wait[:m] = self._no_wait[:m]
        self._tags[0], self._wait[0] = tag_next, wait_next
        padded = self._padded[:n]
        unset = padded.count(_UNSET)
        self._padded[:n] = self._unset[:n]
        if 0 < unset < n:  # some steps passed padded counts and some not: those had none
            for j in range(n):
                if padded[j] == _UNSET:
                    padded[j] = self._tokens[j]
        wall_end = self._last_wall_end = time.time()
        window = Window(
            first_step=first,
            step_time_s=self._time[:n],
            data_wait_s=wait,
            tokens=self._tokens[:n],
            padded_tokens=padded if unset < n else None,
            tags=tags,
            wall_end=wall_end,
            device_events=self._dev.take(n) if self._dev is not None else None,
            final=final,
            comm=self.comm_timing.take(n),
            perf_end=self._last,
            runq_s=self._runq.take(),
        )
        self._first_step = first + n
        self._n = 0
        if self._steering.inbox:
            self._apply_directives()
        self._window_start = now
        self._close_at = now + self._interval
        self._event_i = self._next_event()
        self._sender.submit(window)

    # -- steering ------------------------------------------------------------------------
    def _on_answer(self, body: bytes) -> None:
        """The collector's answer to a batch (sender thread): queue its directives; a
        capture readies the profiler now (its one-time imports, about 1 s of CPU, on the
        profiler thread: with the periodic window off nothing paid them at ``init``), where
        the interpreter allows it off the training thread."""
        pw = self._pw
        if self._steering.receive(body) and pw is not None and pw.warm_cpu_s is None:
            pw.warm(background_only=True)

    def _apply_directives(self) -> None:
        """Apply the collector's new directives (``_steering``; training thread, at a
        window close); each is acknowledged."""
        st = self._steering
        done = self._first_step - 1  # the last finished step
        while True:
            try:
                d = st.inbox.popleft()
            except IndexError:
                return
            ident = d["id"]
            try:
                if d["kind"] == "capture":
                    self._apply_capture(ident, d, done)
                else:
                    self._apply_config(ident, d)
            except Exception as exc:  # never into the training loop
                st.ack(
                    ident, "missed" if d["kind"] == "capture" else "refused", f"could not apply it: {exc!r}"
                )

    def _apply_capture(self, ident: str, d: dict[str, Any], done: int) -> None:
        first, steps = d.get("first_step"), d.get("steps")
        if type(first) is not int or type(steps) is not int:
            self._steering.ack(ident, "missed", "first_step and steps must be integers")
            return
        pw = self._pw
        if pw is None:
            self._steering.ack(
                ident, "missed", "no profiler in this process (torch.profiler is not importable)"
            )
            return
        keep = d.get("trace_max_bytes") if self.rank.rank in (d.get("trace_ranks") or ()) else 0
        keep = keep if type(keep) is int and keep > 0 else 0
        reason = pw.request_capture(first, steps, ident, done, keep_trace=keep)
        if reason is not None:
            self._steering.ack(ident, "missed", reason)
            return
        if not pw.active:
            self._prof_at = pw.next_start(done)
        self._steering.ack(ident, "scheduled")

    def _apply_config(self, ident: str, d: dict[str, Any]) -> None:
        settings, reason = wire.check_live_settings(d.get("settings"))
        pw = self._pw
        if reason is None and ("profile_every" in settings or "profile_steps" in settings):
            if pw is None:
                reason = "no profiler in this process (torch.profiler is not importable)"
            else:
                every = int(settings.get("profile_every", pw.base))
                reason = pw.reconfigure(every, int(settings.get("profile_steps", pw.k)))
                if reason is None and not pw.active:
                    self._prof_at = pw.next_start(self._first_step - 1)
        if reason is not None:
            self._steering.ack(ident, "refused", reason)
            return
        if "send_interval_s" in settings:
            self._interval = settings["send_interval_s"]
            if isinstance(self._sender, Sender):
                self._sender.heartbeat_s = HEARTBEAT_INTERVALS * self._interval
        self._steering.ack(ident, "applied", settings=self._live_settings())

    def _live_settings(self) -> dict[str, float]:
        """The live settings in force (what a config directive's ack reports)."""
        out: dict[str, float] = {"send_interval_s": self._interval}
        if self._pw is not None:
            out["profile_every"] = self._pw.base
            out["profile_steps"] = self._pw.k
        return out

    # -- collectives ----------------------------------------------------------------
    def watch(self, model: Any, state: Any = None, *, per_bucket: bool = False) -> None:
        """Time a DDP ``model``'s gradient reduction on every step: ``sw.watch(ddp_model)``
        before the first backward.

        By default (``per_bucket=False``) DDP keeps its built-in (C++) all-reduce and each
        step's arrival (every bucket launched) and end (every all-reduce done) are read in
        autograd's final callbacks (``_ddp_timing``: three Python calls a step; any Python
        comm hook costs 3-5% of a small model's step on shared cores, issue 11's budget is
        1%). The end is read on the training thread after DDP's finalisation and taken
        back by that thread's own CPU and run-queue time since the arrival, so neither its
        copy of the buckets into the gradients nor its wait for a core counts as time in
        the all-reduce.

        ``per_bucket=True`` registers ``stepwatch.comm_hook`` instead, which times every
        bucket (arrival, end, bytes, a duration sketch per collective type) and runs DDP's
        own reduction over the model's process group (``state``, by default
        ``model.process_group``: a DDP over a data-parallel subgroup must not reduce over
        the world). A model with a comm hook of its own keeps it: register
        ``stepwatch.comm_hook(inner=that_hook)``, or watch it with the default.

        Either way DDP's broadcast of module buffers before each forward is counted too,
        and each step's wait in it timed, so a hang diagnosis can tell a rank waiting in it
        from one that hung, and a rank held there by a late peer is not taken for the late
        one.

        A model on CUDA watched before the first step also starts the device step clock
        when ``init`` did not (CUDA was not initialised then): the timing's device events
        are measured from its step boundaries. Watched later, it keeps host times."""
        if self._dev is None and self._n == 0 and self._first_step == self._start_step + 1:
            from ._api import _model_on_cuda
            from ._device_clock import cuda_clock

            if _model_on_cuda(model):
                self._dev = cuda_clock(self._cap)
        if state is None:
            state = getattr(model, "process_group", None)
        try:
            if per_bucket:
                model.register_comm_hook(state, comm_hook(timing=self.comm_timing))
            elif not time_reduction(model, self.comm_timing):
                raise RuntimeError("no parameter of the model takes a gradient")
            count_buffer_broadcast(model, self.comm_timing)
        except Exception as exc:  # never into the training loop: only the timing is lost
            warnings.warn(
                f"stepwatch: could not install the collective timing ({exc}); steps are timed "
                "without it (with per_bucket=True, a model with its own comm hook: register "
                "stepwatch.comm_hook(inner=your_hook), or watch it with the default)",
                RuntimeWarning,
                stacklevel=2,
            )

    def watch_collectives(self) -> bool:
        """Count the plain ``torch.distributed`` collectives this process calls (tensor and
        pipeline parallel code, FSDP2's all-gathers and reduce-scatters) per process group,
        beside DDP's buckets, so that a hang in them is diagnosed as one in DDP is: which
        rank never entered which collective. Wraps the ``torch.distributed`` module
        functions; what that does not see is in ``stepwatch._collectives``. Returns
        whether the wrappers are in place."""
        try:
            return _collectives.install(self.comm_timing)
        except Exception:
            return False

    # -- data loading --------------------------------------------------------------
    def loader(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield from ``iterable``, charging the time spent waiting for each item to the
        step that consumes it (the data-loader wait)."""
        it = iter(iterable)
        while True:
            t0 = _perf()
            pw = self._pw
            try:
                if pw is not None and pw.active:  # inside a profiler window: mark the wait
                    with pw.record_function(DATA_WAIT_SPAN):
                        item = next(it)
                else:
                    item = next(it)
            except StopIteration:
                return
            self._wait[self._n] += _perf() - t0
            yield item

    def add_data_wait(self, seconds: float) -> None:
        """Charge ``seconds`` of data-loader wait to the step in progress: for loops whose
        loader ``sw.loader`` cannot wrap (the Lightning and Hugging Face callbacks)."""
        try:
            if seconds > 0:
                self._wait[self._n] += float(seconds)
        except (TypeError, ValueError):
            pass

    # -- tags ----------------------------------------------------------------------
    def mark(self, tag: str) -> None:
        """Tag the step in progress as ``warmup``, ``checkpoint`` or ``eval``: such steps
        are kept out of baselines and regression detection."""
        code = TAG_CODES.get(tag)
        if code is None:
            raise ValueError(f"unknown tag {tag!r}; use one of {sorted(TAG_CODES)}")
        self._tags[self._n] = code

    @contextmanager
    def phase(self, tag: str) -> Iterator[None]:
        """``with sw.phase("checkpoint"): save(...)`` tags the step that contains it."""
        self.mark(tag)
        yield

    # -- lifecycle -----------------------------------------------------------------
    def flush(self, timeout_s: float | None = None) -> bool:
        """Close the current window and wait until everything is sent. True if all was."""
        try:
            left = self._drain_profiler(timeout_s)
            if self._n and self._enabled:
                self._close_window(_perf())
            return self._sender.flush(left)
        except Exception as exc:
            self._disable(exc)
            return False

    def close(self, timeout_s: float | None = None) -> bool:
        """Send what is left within the deadline and stop the sender. Idempotent."""
        if self._closed:
            return True
        self._closed = True
        try:
            left = self._drain_profiler(timeout_s)
            # The last window is marked final (even with no steps left in it) so that the
            # collector can tell a rank that finished from one that hangs.
            if self._enabled and (self._n or self._first_step > self._start_step + 1):
                self._close_window(_perf(), final=True)
            self._enabled = False
            self._close_at = _OFF
            return self._sender.close(left)
        except Exception as exc:
            self._disable(exc)
            return False
        finally:
            _collectives.release(self.comm_timing)
            self._runq.close()
            atexit.unregister(self._atexit)

    def _drain_profiler(self, timeout_s: float | None) -> float:
        """Let a window that is being parsed finish (within half the deadline), so its entry
        rides on the last batch. Returns what is left of the deadline for sending."""
        limit = max(0.0, self.config.flush_timeout_s if timeout_s is None else timeout_s)
        if self._pw is None:
            return limit
        t0 = time.monotonic()
        self._pw.drain(limit / 2)
        return max(0.0, limit - (time.monotonic() - t0))

    def _atexit(self) -> None:
        self.close()

    @property
    def stats(self) -> dict[str, Any]:
        """The agent's view of itself: what it sent, dropped, and what it cost per step."""
        s = self._sender.stats
        return {
            "steps": self._first_step - 1 + self._n,
            "sent_batches": s.sent_batches,
            "relayed_batches": s.relayed_batches,
            "sent_steps": s.sent_steps,
            "dropped_windows": s.dropped_windows,
            "dropped_steps": s.dropped_steps,
            "rejected_batches": s.rejected_batches,
            "rejected_steps": s.rejected_steps,
            "failed_attempts": s.failed_attempts,
            "pending_windows": self._sender.pending(),
            "last_error": s.last_error,
            "hot_path_mean_s": self.hot_path_mean_s(),
            "profile": self._pw.stats() if self._pw is not None else None,
        }

    # -- sender thread -------------------------------------------------------------
    def _heartbeat(self) -> Window | None:
        """A step-free window carrying the collective counters (sender thread, while the
        training thread has closed no window for a while). Reads two fields the training
        thread writes (each one store); a window closing meanwhile only makes them a
        window newer. None without counters (no communication hook) or once off."""
        if not self._enabled or not self.comm_timing.seq:
            return None
        none_f, none_q = array("d"), array("q")
        return Window(
            first_step=self._first_step,
            step_time_s=none_f,
            data_wait_s=none_f,
            tokens=none_q,
            padded_tokens=None,
            tags=None,
            wall_end=self._last_wall_end,
            heartbeat=True,
            profiles=[],  # profiler entries ride on the batch of the steps they profiled
        )

    def _step_clock(self, window: Window) -> StepClock:
        """The clock of this window's step times: on CUDA the device's only when every step
        that has a start on the device took its time from it; a window with steps and no
        device events (the sender more than two windows behind: no free generation) was
        timed on the host. A heartbeat or a stepless final batch says the rank's clock."""
        if window.step_clock is not None:
            return window.step_clock
        if self._dev is None or window.n_steps:
            return "host"
        return "cuda_events"

    def _encode(self, window: Window, stats: SenderStats) -> bytes:
        if not window.batch_id:
            window.batch_id = new_batch_id()
        if window.heartbeat and window.comm_section is None:  # once: a retry sends the same body
            # How long the training thread has not finished a step: the collector trusts
            # these counters as where the rank is stuck once that exceeds a few steps.
            idle = _perf() - self._last
            window.comm_section = self.comm_timing.heartbeat_section(idle)
        host_times = window.step_time_s
        device_steps = None
        read: Boundaries | None = None
        if window.device_events is not None:
            prev, read = window.device_events
            step_times, on_device = CudaEventClock.resolve_all(prev, read, window.step_time_s)
            # The hook's device offsets only beside step times that all came from the
            # device (a step kept on the host clock at the deadline would mix units).
            device_steps = (prev, read, step_times) if on_device else None
            window.step_clock = "cuda_events" if on_device else "host"
            window.device_events = None
            window.step_time_s = array("d", step_times)
        if window.comm is not None:  # summarised once, so a retry sends the same body
            # After the step clock's wait for its events: the hook's device events (CUDA)
            # are then read with query() alone; the host's step times place host times.
            window.comm_section = self.comm_timing.summarise(
                window.comm, window.first_step, host_times, window.perf_end, device_steps=device_steps
            )
            if window.runq_s is not None:
                window.comm_section["runq_s"] = round(window.runq_s, 6)
            links = self._links.sample()
            if links:
                window.comm_section["links"] = links
            window.comm = None
        if read is not None:  # every event of the window is read: its generation is free again
            read.release()
        agent = {
            "version": __version__,
            "clock": self._step_clock(window),
            # Every window this rank lost: evicted from the full buffer, or refused by the
            # collector / given up after max_attempts (see SenderStats).
            "dropped_windows": stats.lost_windows,
            "dropped_steps": stats.lost_steps,
            "hot_path_mean_s": self.hot_path_mean_s(),
            "send_interval_s": self._interval,
            "configs": list(self._steering.configs),
        }
        if window.acks is None:
            window.acks = self._steering.take_acks()
        if window.profiles is None:
            window.profiles, window.profiles_through = self._take_profiles(window)
            self._upload_traces()
        payload = build_payload(
            window,
            run=self.config.run,
            rank=self._rank_dict,
            convention=self.convention,
            agent=agent,
            sent_at=time.time(),
            plan=self.plan,
            profiles=window.profiles,
            comm=window.comm_section,
            acks=window.acks,
        )
        return encode(payload)

    def _take_profiles(self, window: Window) -> tuple[list[dict[str, Any]], int | None]:
        """The profiler entries that ride on this batch, and the step through which the
        rank owes no entry (sender thread; ``ProfilerWindow.take_through``). The collector compares a window's
        ranks only once each has sent the profile of the steps it holds: the entry comes
        from the profiler thread, often a batch after its steps, and a window compared
        without it lacks the compute evidence that names a compute straggler (a flag
        then neither opens nor closes on that window)."""
        pw = self._pw
        if pw is None:
            return [], None
        last = max(0, window.first_step + window.n_steps - 1)
        entries, through = pw.take_through(None if window.final else last)
        return entries, min(last, through)

    def _upload_traces(self) -> None:
        """Hand a capture's raw trace (kept by the profiler thread) to the sender, which
        uploads it beside the batches (sender thread)."""
        pw, sender = self._pw, self._sender
        if pw is None or not pw.traces or not isinstance(sender, Sender):
            return
        while pw.traces:
            capture, packed = pw.traces.popleft()
            sender.upload(wire.capture_trace_path(self.config.run, capture, self.rank.rank), packed)

    def _disable(self, exc: BaseException) -> None:
        if self._enabled:
            self._enabled = False
            self._close_at = _OFF
            self._prof_at = NEVER
            if self._pw is not None:  # never leave torch.profiler recording behind
                try:
                    self._pw.drain(0.0)
                except Exception:
                    log.exception("stepwatch: could not stop the profiler window")
            warnings.warn(
                f"stepwatch disabled itself after an internal error ({exc!r}); training is unaffected",
                RuntimeWarning,
                stacklevel=3,
            )
            log.exception("stepwatch: internal error", exc_info=exc)


def _as_count(value: Any, name: str) -> int:
    """Slow path for non-int counts (numpy ints, 0-d tensors)."""
    if getattr(value, "is_cuda", False):
        warnings.warn(
            f"stepwatch: {name} was a CUDA tensor; converting it synchronises the GPU. Pass a Python int.",
            RuntimeWarning,
            stacklevel=3,
        )
    return operator.index(value) if not isinstance(value, float) else int(value)
