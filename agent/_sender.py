"""The background sender: the only part of the agent that does I/O.

Modelled on sentry-python's ``BackgroundWorker``: the training thread appends closed
windows to a bounded deque (no lock, no wait; when full the oldest window is dropped
and counted), and a daemon thread drains it over HTTP with retries, exponential
backoff and full jitter, honouring ``Retry-After``. Every failure stays on this
thread. A process forked from the training process (DataLoader workers) starts with an
empty queue and no thread; one is started again if that process ever submits.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from ._window import Window

log = logging.getLogger("stepwatch")

#: HTTP statuses after which the same batch may succeed later.
_RETRYABLE = frozenset({408, 425, 429, 500, 502, 503, 504})


@dataclass
class SenderStats:
    """Counters the agent reports about itself (cumulative, so retries are harmless)."""

    sent_batches: int = 0
    sent_steps: int = 0
    failed_attempts: int = 0
    rejected_batches: int = 0
    dropped_windows: int = 0
    dropped_steps: int = 0
    last_error: str | None = None


class Sender:
    """Ships windows to ``{url}/api/v1/ingest`` from a daemon thread."""

    def __init__(
        self,
        url: str,
        encode: Callable[[Window, SenderStats], bytes],
        *,
        token: str | None = None,
        max_windows: int = 256,
        max_bytes: int | None = None,
        timeout_s: float = 5.0,
        poll_s: float = 0.5,
        backoff_base_s: float = 0.5,
        backoff_max_s: float = 30.0,
    ) -> None:
        self._endpoint = url.rstrip("/") + "/api/v1/ingest"
        self._encode = encode
        self._headers = {"content-type": "application/json"}
        if token:
            self._headers["authorization"] = f"Bearer {token}"
        self._max_windows = max(1, max_windows)
        self._max_bytes = max_bytes
        # Bytes queued = pushed - dropped (training thread only) - popped (sender thread
        # only): each counter has one writer, so the bound needs no lock.
        self._pushed_bytes = 0
        self._dropped_bytes = 0
        self._popped_bytes = 0
        self._timeout_s = timeout_s
        self._poll_s = poll_s
        self._backoff_base_s = backoff_base_s
        self._backoff_max_s = backoff_max_s
        self.stats = SenderStats()
        self._queue: deque[Window] = deque()
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._deadline: float | None = None
        # The window being sent is owned by the sender thread alone, so the training
        # thread's drop-oldest never discards a batch that is already on the wire.
        self._inflight: Window | None = None
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _after_fork(ref))

    # -- training thread ---------------------------------------------------------
    def submit(self, window: Window) -> None:
        """Queue a closed window; never blocks. Called once per window, not per step."""
        if self._pid != os.getpid():
            self._reset_after_fork()
        q = self._queue
        size = window.approx_bytes()
        cap = self._max_bytes
        while q and (
            len(q) >= self._max_windows
            or (
                cap is not None and self._pushed_bytes - self._dropped_bytes - self._popped_bytes + size > cap
            )
        ):
            try:
                old = q.popleft()
            except IndexError:
                break
            self._dropped_bytes += old.approx_bytes()
            self.stats.dropped_windows += 1
            self.stats.dropped_steps += old.n_steps
        self._idle.clear()
        self._pushed_bytes += size
        q.append(window)
        if self._thread is None:
            self._start()

    def pending(self) -> int:
        return len(self._queue) + (self._inflight is not None)

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until everything queued so far is sent (or given up)."""
        if self._thread is None:
            return not self.pending()
        self._wake.set()
        return self._idle.wait(timeout_s)

    def close(self, timeout_s: float) -> bool:
        """Send what is queued within the deadline, then stop the thread."""
        self._deadline = time.monotonic() + max(0.0, timeout_s)
        self._wake.set()
        t = self._thread
        if t is not None:
            t.join(max(0.0, timeout_s) + 0.5)
        left = self.pending()
        if left:
            log.warning("stepwatch: %d window(s) not sent before the exit deadline", left)
        return left == 0

    # -- sender thread -----------------------------------------------------------
    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="stepwatch-sender", daemon=True)
        self._thread.start()

    def _reset_after_fork(self) -> None:
        self._pid = os.getpid()
        self._queue = deque()
        self._inflight = None
        self._pushed_bytes = self._dropped_bytes = self._popped_bytes = 0
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._thread = None

    def _closing(self) -> bool:
        return self._deadline is not None

    def _past_deadline(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _run(self) -> None:
        with httpx.Client(timeout=self._timeout_s, headers=self._headers) as client:
            backoff = self._backoff_base_s
            while True:
                if self._inflight is None:
                    try:
                        self._inflight = self._queue.popleft()
                        self._popped_bytes += self._inflight.approx_bytes()
                    except IndexError:
                        self._idle.set()
                        if self._queue:  # appended meanwhile: not idle after all
                            self._idle.clear()
                            continue
                        if self._closing():
                            return
                        self._wake.wait(self._poll_s)
                        self._wake.clear()
                        continue
                window = self._inflight
                delay = self._send(client, window)
                if delay is None:  # sent, or rejected for good
                    self._inflight = None
                    backoff = self._backoff_base_s
                    continue
                if self._past_deadline():
                    return
                # Full jitter (AWS architecture blog): spreads a fleet's retries.
                wait = max(delay, random.uniform(0.0, backoff))
                if self._deadline is not None:
                    wait = min(wait, max(0.0, self._deadline - time.monotonic()))
                self._wake.wait(wait)
                self._wake.clear()
                backoff = min(self._backoff_max_s, backoff * 2)

    def _send(self, client: httpx.Client, window: Window) -> float | None:
        """POST one window. None when done with it; else seconds to wait before retrying."""
        try:
            body = self._encode(window, self.stats)
        except Exception as exc:  # a bug in encoding must cost one window, not the thread
            self.stats.rejected_batches += 1
            self.stats.last_error = f"encode: {exc!r}"
            log.warning("stepwatch: could not encode a window, dropped: %r", exc)
            return None
        try:
            resp = client.post(self._endpoint, content=body)
        except (httpx.HTTPError, OSError) as exc:
            self.stats.failed_attempts += 1
            self.stats.last_error = repr(exc)
            return 0.0
        if resp.is_success:
            self.stats.sent_batches += 1
            self.stats.sent_steps += window.n_steps
            return None
        self.stats.last_error = f"HTTP {resp.status_code}: {resp.text[:200]}"
        if resp.status_code in _RETRYABLE:
            self.stats.failed_attempts += 1
            return _retry_after(resp)
        self.stats.rejected_batches += 1
        log.warning("stepwatch: collector rejected a batch: %s", self.stats.last_error)
        return None


def _retry_after(resp: httpx.Response) -> float:
    value = resp.headers.get("retry-after", "")
    try:
        return min(60.0, max(0.0, float(value)))
    except ValueError:
        return 0.0


def _after_fork(ref: weakref.ref[Sender]) -> None:
    sender = ref()
    if sender is not None:
        sender._reset_after_fork()
