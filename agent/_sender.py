"""The background sender: the only part of the agent that does I/O.

Modelled on sentry-python's ``BackgroundWorker``: the training thread appends closed
windows to a bounded deque (no lock, no wait; when full the oldest window is dropped
and counted), and a daemon thread drains it over HTTP. What a failed attempt means and
how long to wait after it is ``stepwatch.retry``'s policy: a collector that is away or
busy is waited for (the buffer keeps the windows), a batch the collector fails on (5xx)
is given up after ``max_attempts`` and a batch it refuses (4xx) at once, counted, so that
one bad batch never holds up the windows behind it.

The user hears about trouble early and once: the first failure logs one warning naming
the URL and the reason (connection refused, name not resolved, no answer, HTTP 401 with
the collector's message ...) and how many windows wait; it is repeated at most every
``warn_every_s``, and one line says when delivery resumes. Every failure stays on this
thread. ``close()`` returns at its deadline even when a request hangs: the thread is then
left behind (a daemon) rather than joined. A process forked from the training process
(DataLoader workers) starts with an empty queue and no thread; one is started again if
that process ever submits.

Heartbeats: with ``heartbeat`` given, a thread that finds nothing to send for
``heartbeat_s`` (no window submitted, no heartbeat sent in that time) asks it for a
step-free window and sends that. A training thread blocked in a collective closes no
window, but this thread still runs, so the collector still learns where the rank is
(the collective counters of a hang's diagnosis).

Longer than the usual module: the queue's bound, the retry loop, the heartbeats and the
warnings share the sender thread's state; ``MemorySink`` sits beside the ``Sender`` it
stands in for.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ._relay import NO_ANSWER, RelayClient, supported
from ._relay import stop_all as stop_relays
from ._window import Window
from .retry import Verdict, full_jitter, retry_after_s, verdict

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("stepwatch")

#: Seconds ``close`` gives the host's relay this process runs to hand on (it posts the
#: entries it holds: one request, if any), when the deadline has less left.
RELAY_STOP_S = 0.05
#: Seconds of the close deadline a raw-trace upload needs left to be tried (``_may_upload``).
UPLOAD_MIN_LEFT_S = 1.0


@dataclass
class SenderStats:
    """Counters the agent reports about itself (cumulative, so retries are harmless).

    ``dropped_*`` are written by the training thread only (the full buffer's evictions),
    ``rejected_*`` by the sender thread only (batches refused or given up), so neither
    needs a lock; the payload reports their sum as the windows this rank lost."""

    sent_batches: int = 0
    sent_steps: int = 0
    #: Of ``sent_batches``, those the host's relay posted (``host_batch``).
    relayed_batches: int = 0
    failed_attempts: int = 0
    rejected_batches: int = 0
    rejected_steps: int = 0
    dropped_windows: int = 0
    dropped_steps: int = 0
    last_error: str | None = None
    #: Raw traces of captures uploaded, or not (sender thread).
    uploads: int = 0
    failed_uploads: int = 0

    @property
    def lost_windows(self) -> int:
        return self.dropped_windows + self.rejected_batches

    @property
    def lost_steps(self) -> int:
        return self.dropped_steps + self.rejected_steps


class _Every:
    """True at the first call, then at most once every ``period_s`` (by ``clock``)."""

    def __init__(self, period_s: float, clock: Callable[[], float]) -> None:
        self._period_s = period_s
        self._clock = clock
        self._last: float | None = None

    def __call__(self) -> bool:
        now = self._clock()
        if self._last is not None and now - self._last < self._period_s:
            return False
        self._last = now
        return True


class WindowSink(Protocol):
    """What the agent needs of whatever takes its closed windows (:class:`Sender` ships
    them; :class:`MemorySink` keeps them)."""

    stats: SenderStats

    def submit(self, window: Window) -> None: ...
    def pending(self) -> int: ...
    def flush(self, timeout_s: float) -> bool: ...
    def close(self, timeout_s: float) -> bool: ...


class MemorySink:
    """Keeps every closed window in a list instead of sending it.

    For readers of the agent's windows in the same process: ``make gpu-check`` reads the
    CUDA event times of the steps from them (the HTTP path is tested without a GPU), and
    the unit tests read what the hot path stored.
    """

    def __init__(self) -> None:
        self.windows: list[Window] = []
        self.stats = SenderStats()
        self.closed = False

    def submit(self, window: Window) -> None:
        self.windows.append(window)

    def pending(self) -> int:
        return 0

    def flush(self, timeout_s: float) -> bool:
        return True

    def close(self, timeout_s: float) -> bool:
        self.closed = True
        return True


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
        max_attempts: int = 5,
        warn_every_s: float = 60.0,
        label: str = "",
        clock: Callable[[], float] = time.monotonic,
        heartbeat: Callable[[], Window | None] | None = None,
        heartbeat_s: float = 15.0,
        on_answer: Callable[[bytes], None] | None = None,
        host_batch: bool = False,
    ) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
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
        self._max_attempts = max_attempts
        self._who = f"stepwatch ({label})" if label else "stepwatch"
        self._clock = clock
        self._warn_waiting = _Every(warn_every_s, clock)
        self._warn_dropped = _Every(warn_every_s, clock)
        self._said_trouble = False
        self.stats = SenderStats()
        self._queue: deque[Window] = deque()
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._deadline: float | None = None
        # The window being sent is owned by the sender thread alone, so the training
        # thread's drop-oldest never discards a batch that is already on the wire.
        self._inflight: Window | None = None
        self._attempts = 0  # counted (5xx) attempts of the window in flight
        self._posting_since: float | None = None  # clock() when the POST on the wire began
        self._thread: threading.Thread | None = None
        self._heartbeat = heartbeat
        #: Written by the training thread when the send interval changes (one store).
        self.heartbeat_s = heartbeat_s
        self._on_answer = on_answer
        #: Bodies to PUT beside the batches (a capture's raw trace): (path, gzipped bytes);
        #: best effort, one attempt each, after the windows waiting.
        self._uploads: deque[tuple[str, bytes]] = deque(maxlen=4)
        self._base = url.rstrip("/")
        #: Per-host batching (``_relay``): this rank's windows go through the host's relay.
        relayed = host_batch and supported()
        self._relay = RelayClient(url, token, self._headers, timeout_s) if relayed else None
        #: clock() of the last submit or heartbeat (written by both threads: one store each).
        self._last_activity = clock()
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
        self._last_activity = self._clock()
        if self._thread is None:
            self.start()

    def pending(self) -> int:
        return len(self._queue) + (self._inflight is not None)

    def upload(self, path: str, body: bytes) -> None:
        """Queue a gzipped body to PUT at ``path`` (sender thread, from the encoder)."""
        self._uploads.append((path, body))

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until everything queued so far is sent (or given up)."""
        if self._thread is None:
            return not self.pending()
        self._wake.set()
        return self._idle.wait(timeout_s)

    def close(self, timeout_s: float) -> bool:
        """Send what is queued within the deadline, then stop the thread.

        Returns at the deadline whatever the thread is doing: a request that hangs (a
        black-holed collector, a name lookup that takes its time) is left to the daemon
        thread, not waited for."""
        deadline = self._clock() + max(0.0, timeout_s)
        self._deadline = deadline
        self._wake.set()
        t = self._thread
        while t is not None and t.is_alive():
            left = deadline - self._clock()
            if left <= 0:
                break
            t.join(min(left, 0.1))
        if self._relay is not None:  # this process's relay, if it runs one, hands on
            stop_relays(max(RELAY_STOP_S, deadline - self._clock()))
        left_behind = self.pending()
        if left_behind:
            why = [f"last error: {self.stats.last_error}"] if self.stats.last_error else []
            since = self._posting_since
            if since is not None:
                why.append(f"no answer within {self._clock() - since:.1f} s to the request in flight")
            reason = f" ({'; '.join(why)})" if why else ""
            log.warning(
                "%s: %d window(s) not sent to %s before the exit deadline (%g s)%s",
                self._who,
                left_behind,
                self._endpoint,
                timeout_s,
                reason,
            )
        return left_behind == 0

    def start(self) -> None:
        """Start the sending thread (``init`` does, so that no training step pays for it;
        a forked child that submits starts its own). Idempotent."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="stepwatch-sender", daemon=True)
            self._thread.start()

    # -- sender thread -----------------------------------------------------------

    def _reset_after_fork(self) -> None:
        self._pid = os.getpid()
        if self._relay is not None:
            self._relay.close()
        self._queue = deque()
        self._inflight = None
        self._attempts = 0
        self._posting_since = None
        self._pushed_bytes = self._dropped_bytes = self._popped_bytes = 0
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._thread = None

    def _closing(self) -> bool:
        return self._deadline is not None

    def _time_left(self) -> float | None:
        """Seconds to the close deadline, or None while not closing."""
        return None if self._deadline is None else self._deadline - self._clock()

    def _run(self) -> None:
        # Imported here, on this thread: httpx (and, when they are installed, the rich and
        # pygments of its command-line client) stays out of `import stepwatch` and off the
        # training thread.
        import httpx

        with httpx.Client(timeout=self._timeout_s, headers=self._headers) as client:
            failures = 0  # consecutive failed attempts, whatever the batch: the backoff
            while True:
                if self._inflight is None:
                    try:
                        self._inflight = self._queue.popleft()
                        self._attempts = 0
                        self._popped_bytes += self._inflight.approx_bytes()
                    except IndexError:
                        if self._uploads and self._may_upload():  # windows sent: a raw trace now
                            self._put(client, *self._uploads.popleft())
                            continue
                        self._idle.set()
                        if self._queue:  # appended meanwhile: not idle after all
                            self._idle.clear()
                            continue
                        if self._closing():
                            return
                        beat = self._due_heartbeat()
                        if beat is not None:
                            self._inflight = beat
                            self._attempts = 0
                            continue
                        self._wake.wait(self._poll_s)
                        self._wake.clear()
                        continue
                window = self._inflight
                sent = self.stats.sent_batches
                delay = self._send(client, window)
                if delay is None:  # sent, or given up
                    self._inflight = None
                    if self.stats.sent_batches > sent:
                        failures = 0
                    continue
                failures += 1
                left = self._time_left()
                if left is not None and left <= 0:
                    return
                wait = max(delay, full_jitter(failures, self._backoff_base_s, self._backoff_max_s))
                if left is not None:
                    wait = min(wait, left)
                self._wake.wait(wait)
                self._wake.clear()

    def _due_heartbeat(self) -> Window | None:
        """A heartbeat window when one is due (nothing sent for ``heartbeat_s``), else None."""
        if self._heartbeat is None or self._clock() - self._last_activity < self.heartbeat_s:
            return None
        self._last_activity = self._clock()
        try:
            return self._heartbeat()
        except Exception:  # a heartbeat is best effort: never the thread
            log.exception("%s: could not build a heartbeat", self._who)
            return None

    def _send(self, client: httpx.Client, window: Window) -> float | None:
        """POST one window. None when done with it; else seconds to wait before retrying."""
        try:
            body = self._encode(window, self.stats)
        except Exception as exc:  # a bug in encoding must cost one window, not the thread
            self._give_up(window, f"could not encode it: {exc!r}")
            return None
        import httpx

        timeout = self._request_timeout()
        self._posting_since = self._clock()
        try:
            resp = self._relayed(body, timeout)
            relayed = resp is not None
            if resp is None:
                if self._relay is not None:  # the relay's answer "alone" took time
                    timeout = self._request_timeout()
                resp = client.post(self._endpoint, content=body, timeout=timeout)
        except (httpx.HTTPError, OSError) as exc:
            self._posting_since = None
            self.stats.failed_attempts += 1
            self.stats.last_error = _describe(exc, timeout)
            self._waiting()
            return 0.0
        self._posting_since = None
        outcome = verdict(resp.status_code)
        if outcome is Verdict.DONE:
            self.stats.sent_batches += 1
            self.stats.relayed_batches += relayed
            self.stats.sent_steps += window.n_steps
            self._delivered()
            if self._on_answer is not None:
                try:  # the collector's directives for this rank (``_steering``)
                    self._on_answer(resp.content)
                except Exception:
                    log.exception("%s: could not read the collector's answer", self._who)
            return None
        reason = _refusal(resp)
        if outcome is Verdict.REFUSED:
            self._give_up(window, f"the collector refused it ({reason})")
            return None
        self.stats.failed_attempts += 1
        self.stats.last_error = reason
        if outcome is Verdict.RETRY:
            self._attempts += 1
            if self._attempts >= self._max_attempts:
                self._give_up(window, f"{self._attempts} attempts failed (last: {reason})")
                return None
        self._waiting()
        return retry_after_s(resp.headers.get("retry-after")) or 0.0

    def _request_timeout(self) -> float:
        """The HTTP timeout, cut to what is left of the close deadline while closing."""
        left = self._time_left()
        return self._timeout_s if left is None else max(0.01, min(self._timeout_s, left))

    def _relayed(self, body: bytes, timeout: float) -> httpx.Response | None:
        """The answer to ``body`` posted by the host's relay, as a lone POST's response;
        None when this rank is to post it alone (no relay, or the relay says so)."""
        if self._relay is None:
            return None
        import httpx

        try:
            answer = self._relay.post(body, timeout)
        except OSError as exc:
            raise OSError(f"the host's relay went away with this window ({_describe(exc, timeout)})") from exc
        if answer is None:
            return None
        if answer.status == NO_ANSWER:  # the relay could not reach the collector
            raise OSError(answer.content.decode(errors="replace"))
        headers = {} if answer.retry_after_s is None else {"retry-after": f"{answer.retry_after_s:g}"}
        return httpx.Response(answer.status, headers=headers, content=answer.content)

    def _may_upload(self) -> bool:
        """A raw trace goes once every window is sent, also while closing if the deadline
        leaves :data:`UPLOAD_MIN_LEFT_S`: a capture near the end of a run (its flag opened
        late on a busy host) has its trace queued by the last batches, and a close that
        dropped it lost the one trace the capture asked for."""
        left = self._time_left()
        return left is None or left >= UPLOAD_MIN_LEFT_S

    def _put(self, client: httpx.Client, path: str, body: bytes) -> None:
        """One best-effort upload: a failure is counted and logged, never retried (the
        explanation does not need it; the next capture may ask again)."""
        import httpx

        headers = {"content-type": "application/gzip"}
        left = self._time_left()
        timeout = self._timeout_s if left is None else max(0.1, min(self._timeout_s, left))
        try:
            resp = client.put(self._base + path, content=body, headers=headers, timeout=timeout)
            ok = resp.status_code < 300
            why = "" if ok else _refusal(resp)
        except (httpx.HTTPError, OSError) as exc:
            ok, why = False, _describe(exc, self._timeout_s)
        if ok:
            self.stats.uploads += 1
        else:
            self.stats.failed_uploads += 1
            log.warning("%s: could not upload %s (%d bytes): %s", self._who, path, len(body), why)

    def _waiting(self) -> None:
        if self._warn_waiting():
            self._said_trouble = True
            log.warning(
                "%s: cannot deliver to the collector at %s: %s; %d window(s) waiting, retrying "
                "(this warning repeats at most once a minute)",
                self._who,
                self._endpoint,
                self.stats.last_error,
                self.pending(),
            )

    def _delivered(self) -> None:
        if self._said_trouble:  # the rate limit stays: a flapping collector warns once a minute
            self._said_trouble = False
            log.warning("%s: delivering to the collector at %s again", self._who, self._endpoint)

    def _give_up(self, window: Window, why: str) -> None:
        if window.heartbeat:  # no step lost: the next heartbeat says the same, newer
            self.stats.last_error = why
            return
        self.stats.rejected_batches += 1
        self.stats.rejected_steps += window.n_steps
        self.stats.last_error = why
        if self._warn_dropped():
            log.warning(
                "%s: dropped a batch of %d step(s) sent to %s: %s; %d batch(es) dropped so far, "
                "%d window(s) waiting (this warning repeats at most once a minute)",
                self._who,
                window.n_steps,
                self._endpoint,
                why,
                self.stats.rejected_batches,
                self.pending() - 1,
            )


def _describe(exc: BaseException, timeout_s: float) -> str:
    """One readable reason for a failed connection: what a user can act on."""
    import httpx  # already loaded by the sender thread; kept off `import stepwatch`

    if isinstance(exc, httpx.TimeoutException):
        return f"no answer within {timeout_s:g} s ({type(exc).__name__})"
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"


def _refusal(resp: httpx.Response) -> str:
    """``HTTP 401: <the collector's detail>``, the message cut to 200 characters."""
    text = resp.text
    try:
        detail = json.loads(text).get("detail")
        if isinstance(detail, str):
            text = detail
    except (ValueError, AttributeError):
        pass
    where = resp.headers.get("location")
    suffix = f" (redirected to {where}; use that URL)" if where else ""
    if resp.status_code in (401, 403):
        suffix = "; check STEPWATCH_TOKEN (or token=) against the collector's STEPWATCH_WRITE_TOKENS"
    return f"HTTP {resp.status_code}: {text.strip()[:200]}{suffix}"


def _after_fork(ref: weakref.ref[Sender]) -> None:
    sender = ref()
    if sender is not None:
        sender._reset_after_fork()
