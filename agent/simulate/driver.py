"""Drive the agent's real send path with simulated ranks: windows -> payloads -> Sender -> HTTP.

Each simulated rank produces, per window, the same :class:`~stepwatch._window.Window` the
hot path hands to the sender (per-step step time, data-loader wait, tokens, tags), plus
the window's time breakdown as the payload's ``profile`` section. Payloads are built by
:func:`stepwatch._payload.build_payload` and sent by :class:`stepwatch._sender.Sender`
instances (their threads, retries, backoff and idempotent batch ids), ``senders`` of them
shared by all ranks, so thousands of ranks do not need thousands of threads. The
simulator waits when a sender's queue is long (it must not drop windows on purpose).
With ``replicas``, the senders are spread over several collector URLs, as a load
balancer in front of collector replicas would spread the agents.

Clocks: ``sim`` stamps each window with a simulated wall clock that starts now and
advances by the simulated step times (so calendar efficiency and the finish date are those
of the simulated run; timestamps run ahead of real time, so no hang is ever seen); ``real``
paces windows in real time and stamps them with the real clock, which hang detection
needs (hang and silent faults switch to it).
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from .. import __version__
from .._payload import build_payload, encode, new_batch_id
from .._sender import Sender, SenderStats
from .._window import TAG_CODES, Window
from .entries import profile_entries
from .model import TimingModel, WindowTimings

Clock = Literal["sim", "real"]


@dataclass
class SimWindow(Window):
    """A window of one simulated rank, with its time breakdown."""

    rank: int = 0


@dataclass
class SimResult:
    """What a simulation sent."""

    run: str
    windows: int
    batches: int
    sent_batches: int
    failed_attempts: int
    rejected_batches: int
    dropped_windows: int
    elapsed_s: float
    last_step: int
    hung: bool
    collector_window_steps: int | None


class WindowMismatchError(RuntimeError):
    """The collector chose other window boundaries than the simulator's windows."""


class Simulation:
    """Send a :class:`TimingModel`'s windows for every rank to a collector."""

    def __init__(
        self,
        model: TimingModel,
        *,
        url: str,
        run: str,
        token: str | None = None,
        senders: int = 8,
        replicas: Sequence[str] = (),
        clock: Clock = "sim",
        profile_every: int = 1,
        plan: Mapping[str, Any] | None = None,
        check_windows: bool = True,
        max_pending: int = 64,
        on_window: Callable[[WindowTimings], None] | None = None,
    ) -> None:
        self.model = model
        self.url = url.rstrip("/")
        self.run = run
        self.token = token
        self.clock: Clock = "real" if any(f.kind in ("hang", "silent") for f in model.faults) else clock
        self.profile_every = max(1, profile_every)
        self.plan = dict(plan) if plan else None
        self.check_windows = check_windows
        self.max_pending = max_pending
        self.on_window = on_window
        topo = model.topology
        self._rank_info = [topo.rank_info(r) for r in range(topo.world)]
        urls = [self.url, *(u.rstrip("/") for u in replicas)]
        self._senders = [
            Sender(
                urls[i % len(urls)],
                self._encode,
                token=token,
                max_windows=1_000_000,
                timeout_s=30.0,
                poll_s=0.02,
                backoff_base_s=0.1,
                backoff_max_s=5.0,
            )
            for i in range(max(1, senders, len(urls)))
        ]

    def _encode(self, window: Window, stats: SenderStats) -> bytes:
        assert isinstance(window, SimWindow)
        if not window.batch_id:
            window.batch_id = new_batch_id()
        agent = {
            "version": __version__,
            "clock": "host",
            "dropped_windows": stats.lost_windows,
            "dropped_steps": stats.lost_steps,
            "hot_path_mean_s": None,
        }
        payload = build_payload(
            window,
            run=self.run,
            rank=self._rank_info[window.rank],
            convention=self.model.convention,
            agent=agent,
            sent_at=time.time(),
            plan=self.plan,
            profiles=window.profiles,
        )
        return encode(payload)

    def _submit(self, window: SimWindow) -> None:
        sender = self._senders[window.rank % len(self._senders)]
        while sender.pending() > self.max_pending:
            time.sleep(0.002)
        sender.submit(window)

    def _flush(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        for s in self._senders:
            s.flush(max(0.1, deadline - time.monotonic()))

    def collector_window_steps(self) -> int | None:
        headers = {"authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            r = httpx.get(f"{self.url}/api/v1/runs/{self.run}", headers=headers, timeout=10.0)
        except httpx.HTTPError:
            return None
        return int(r.json()["window_steps"]) if r.status_code == 200 else None

    def run_windows(self, n_windows: int) -> SimResult:
        """Send ``n_windows`` windows of every rank (fewer after a hang); flush; report."""
        model = self.model
        world = model.topology.world
        t_start = time.time()
        mono_start = time.monotonic()
        sim_elapsed = 0.0
        batches = 0
        last = 0
        sent_windows = 0
        collector_steps: int | None = None
        tokens = model.tokens_per_replica
        try:
            for wt in model.windows(n_windows):
                sim_elapsed += sum(wt.step_time_s)
                if self.clock == "real":
                    delay = mono_start + sim_elapsed - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
                    wall_end = time.time()
                else:
                    wall_end = t_start + sim_elapsed
                final = wt.index == n_windows - 1
                profiled = wt.index % self.profile_every == 0
                n = wt.n_steps
                codes = [TAG_CODES[t] if t else 0 for t in wt.tags]
                times = array("d", wt.step_time_s)
                tok = array("q", [tokens] * n)
                tags = array("b", codes) if any(codes) else None
                entries = profile_entries(model, wt, wall_end - sum(wt.step_time_s)) if profiled else {}
                for r in range(world):
                    if r in wt.silent:
                        continue
                    self._submit(
                        SimWindow(
                            first_step=wt.first_step,
                            step_time_s=times,
                            data_wait_s=array("d", wt.data_wait_s[r]),
                            tokens=tok,
                            padded_tokens=None,
                            tags=tags,
                            wall_end=wall_end,
                            final=final,
                            profiles=[entries[r]] if r in entries else [],
                            rank=r,
                        )
                    )
                    batches += 1
                sent_windows += 1
                last = wt.last_step
                if wt.index == 0 and self.check_windows:
                    self._flush()
                    collector_steps = self.collector_window_steps()
                    if collector_steps is not None and collector_steps != model.steps_per_window:
                        raise WindowMismatchError(
                            f"the collector stores windows of {collector_steps} steps, the simulator "
                            f"sends {model.steps_per_window}: pass --steps-per-window {collector_steps} "
                            "(or match --window-seconds to the collector's STEPWATCH_WINDOW_SECONDS)"
                        )
                if self.on_window is not None:
                    self.on_window(wt)
            self._flush()
        finally:
            for s in self._senders:
                s.close(5.0)
        stats = [s.stats for s in self._senders]
        return SimResult(
            run=self.run,
            windows=sent_windows,
            batches=batches,
            sent_batches=sum(s.sent_batches for s in stats),
            failed_attempts=sum(s.failed_attempts for s in stats),
            rejected_batches=sum(s.rejected_batches for s in stats),
            dropped_windows=sum(s.dropped_windows for s in stats),
            elapsed_s=time.time() - t_start,
            last_step=last,
            hung=model.hang_at is not None and model.hang_at < n_windows,
            collector_window_steps=collector_steps,
        )
