"""Optional webhook for flags: Slack- or Alertmanager-compatible JSON, sent off-thread.

``STEPWATCH_WEBHOOK_URL`` turns it on; ``STEPWATCH_WEBHOOK_FORMAT`` picks the body:

``slack``
    ``{"text": "..."}``, what Slack incoming webhooks (and Mattermost, Rocket.Chat,
    Discord's ``/slack`` endpoint) accept: one line per flag that opened or closed.
``alertmanager``
    a JSON list of alerts as Alertmanager's ``POST /api/v2/alerts`` takes them (labels
    ``alertname``, ``run``, ``key``, ``kind``, ``cause``, ``severity``; annotations
    ``summary`` and the cost; ``startsAt``, and ``endsAt`` once closed), so the URL can be
    an Alertmanager that routes to the channel people already watch. Like Prometheus,
    the notifier re-sends the alerts that are still firing every ``resend_s`` (Alertmanager
    resolves an alert it has not heard of for its ``resolve_timeout``).

The analysis worker calls :meth:`WebhookNotifier.notify` after its transaction commits;
the call only appends to a bounded queue (the oldest message is dropped and counted when
it is full) and wakes a daemon thread, which POSTs with a timeout and retries transient
failures (connection errors, 408, 425, 429, 5xx: :mod:`stepwatch.retry`, the policy the
agent's sender uses too) with full-jitter backoff, never sooner than the receiver's
``Retry-After``, up to ``max_attempts``. Ingest never waits for it. Delivery is at most once per
transition across collector restarts: a message still queued when the process exits is
lost (the event itself is in the database and on the API).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal

import httpx

from stepwatch.retry import Verdict, full_jitter, retry_after_s, verdict

from ..analysis.types import Finding

log = logging.getLogger("stepwatch_server.worker.webhook")

Format = Literal["slack", "alertmanager"]
_ALERTNAMES = {
    "straggler": "StepwatchStraggler",
    "regression": "StepwatchRegression",
    "hang": "StepwatchHang",
}


@dataclass
class WebhookStats:
    """Cumulative counters (exported as Prometheus counters by the app)."""

    delivered: int = 0
    failed: int = 0
    dropped: int = 0
    attempts: int = 0


@dataclass
class _Message:
    body: bytes
    attempts: int = 0
    due: float = 0.0
    resend: bool = False


@dataclass
class _Firing:
    alert: dict[str, Any]
    since: str = field(default="")


def _iso(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, timezone.utc).isoformat().replace("+00:00", "Z")


def slack_body(run: str, finding: Finding) -> dict[str, Any]:
    """A Slack incoming-webhook body for one flag."""
    state = "open" if finding.status == "open" else "resolved"
    return {"text": f"[stepwatch] run {run}: {finding.kind} {state}. {finding.message}"}


def alertmanager_alert(
    run: str, finding: Finding, *, starts_at: str, ends_at: str | None, public_url: str | None
) -> dict[str, Any]:
    """One alert in Alertmanager's ``postableAlert`` shape."""
    labels = {
        "alertname": _ALERTNAMES[finding.kind],
        "source": "stepwatch",
        "run": run,
        "key": finding.key,
        "kind": finding.kind,
        "severity": "critical" if finding.kind == "hang" else "warning",
    }
    if finding.cause:
        labels["cause"] = finding.cause
    annotations = {
        "summary": finding.message,
        "first_step": str(finding.first_step),
        "cost_seconds": f"{finding.cost_seconds:.6g}",
        "cost_ratio": f"{finding.cost_ratio:.6g}",
    }
    if finding.ranks:
        annotations["ranks"] = ",".join(str(r) for r in finding.ranks[:64])
    if finding.hosts:
        annotations["hosts"] = ",".join(finding.hosts[:64])
    stuck = finding.collective
    if stuck is not None:  # a hang's diagnosis, for routing and templates
        annotations["collective"] = (
            f"{stuck.get('op') or 'collective'} #{stuck.get('seq')} of group {stuck.get('group')}"
        )
        annotations["never_entered"] = ",".join(str(r) for r in list(stuck.get("never_entered", ()))[:64])
        annotations["waiting_ranks"] = str(len(stuck.get("waiting", ())))
    alert: dict[str, Any] = {"labels": labels, "annotations": annotations, "startsAt": starts_at}
    if ends_at is not None:
        alert["endsAt"] = ends_at
    if public_url:
        alert["generatorURL"] = f"{public_url.rstrip('/')}/api/v1/runs/{run}/events"
    return alert


class WebhookNotifier:
    """Bounded, retrying, non-blocking delivery of flag transitions (see the module docstring)."""

    def __init__(
        self,
        url: str,
        *,
        fmt: Format = "slack",
        timeout_s: float = 5.0,
        max_attempts: int = 8,
        backoff_base_s: float = 1.0,
        backoff_max_s: float = 60.0,
        resend_s: float = 60.0,
        max_queue: int = 1000,
        public_url: str | None = None,
        on_outcome: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if fmt not in ("slack", "alertmanager"):
            raise ValueError(f"unknown webhook format {fmt!r}; use slack or alertmanager")
        self.url = url
        self.fmt = fmt
        self._timeout_s = timeout_s
        self._max_attempts = max(1, max_attempts)
        self._backoff_base_s = backoff_base_s
        self._backoff_max_s = backoff_max_s
        self._resend_s = resend_s
        self._max_queue = max(1, max_queue)
        self._public_url = public_url
        self._on_outcome = on_outcome
        self._clock = clock
        self.stats = WebhookStats()
        self._queue: deque[_Message] = deque()
        self._firing: dict[tuple[str, str], _Firing] = {}
        self._last_resend = clock()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- caller side (the analysis worker) ----------------------------------------
    def notify(self, run: str, finding: Finding) -> None:
        """Queue one transition (opened or closed); never blocks, never raises."""
        try:
            now = self._clock()
            if self.fmt == "slack":
                self._put(_Message(json.dumps(slack_body(run, finding)).encode()))
                return
            ident = (run, finding.key)
            with self._lock:
                firing = self._firing.pop(ident, None)
                since = firing.since if firing else _iso(now)
                ends = _iso(now) if finding.status == "closed" else None
                alert = alertmanager_alert(
                    run, finding, starts_at=since, ends_at=ends, public_url=self._public_url
                )
                if ends is None:
                    self._firing[ident] = _Firing(alert, since)
                    while len(self._firing) > self._max_queue:
                        self._firing.pop(next(iter(self._firing)))
            self._put(_Message(json.dumps([alert]).encode()))
        except Exception:  # a notifier bug must never reach the analysis
            log.exception("webhook: could not queue a notification")

    def _put(self, msg: _Message) -> None:
        with self._lock:
            while len(self._queue) >= self._max_queue:
                self._queue.popleft()
                self.stats.dropped += 1
                self._outcome("dropped")
            self._queue.append(msg)
        self._wake.set()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="stepwatch-webhook", daemon=True)
            self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (what is still queued after ``timeout_s`` is lost)."""
        deadline = time.monotonic() + timeout_s
        while self.pending() and time.monotonic() < deadline and self._thread is not None:
            self._wake.set()
            time.sleep(0.02)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()) + 1.0)

    def pending(self) -> int:
        with self._lock:
            return len(self._queue)

    # -- delivery thread ------------------------------------------------------------
    def _outcome(self, name: str) -> None:
        if self._on_outcome is not None:
            self._on_outcome(name)

    def _run(self) -> None:
        with httpx.Client(timeout=self._timeout_s, headers={"content-type": "application/json"}) as client:
            while not self._stop.is_set():
                self._maybe_resend()
                msg, wait = self._next_due()
                if msg is None:
                    self._wake.wait(wait)
                    self._wake.clear()
                    continue
                self._deliver(client, msg)

    def _maybe_resend(self) -> None:
        if self.fmt != "alertmanager" or self._resend_s <= 0:
            return
        now = self._clock()
        with self._lock:
            if not self._firing or now - self._last_resend < self._resend_s:
                return
            if any(m.resend for m in self._queue):
                return
            alerts = [f.alert for f in self._firing.values()]
        self._last_resend = now
        self._put(_Message(json.dumps(alerts).encode(), resend=True))

    def _next_due(self) -> tuple[_Message | None, float]:
        now = time.monotonic()
        with self._lock:
            for i, msg in enumerate(self._queue):
                if msg.due <= now:
                    del self._queue[i]
                    return msg, 0.0
            soonest = min((m.due for m in self._queue), default=now + 1.0)
        return None, max(0.01, min(soonest - now, 1.0))

    def _deliver(self, client: httpx.Client, msg: _Message) -> None:
        msg.attempts += 1
        self.stats.attempts += 1
        retry_after: str | None = None
        try:
            resp = client.post(self.url, content=msg.body)
            status: int | None = resp.status_code
            retry_after = resp.headers.get("retry-after")
        except (httpx.HTTPError, OSError) as exc:
            status = None
            log.warning("webhook: POST failed (%s), attempt %d", exc.__class__.__name__, msg.attempts)
        outcome = verdict(status)
        if outcome is Verdict.DONE:
            self.stats.delivered += 1
            self._outcome("delivered")
            return
        # A receiver that is away (WAIT) is retried like one that failed (RETRY): a
        # notification is worth a bounded number of attempts, not a queue held forever.
        if outcome is Verdict.REFUSED or msg.attempts >= self._max_attempts:
            self.stats.failed += 1
            self._outcome("failed")
            log.warning("webhook: giving up after %d attempt(s) (last status %s)", msg.attempts, status)
            return
        wait = full_jitter(msg.attempts, self._backoff_base_s, self._backoff_max_s)
        wait = max(wait, retry_after_s(retry_after, cap_s=self._backoff_max_s) or 0.0)
        msg.due = time.monotonic() + wait
        with self._lock:
            self._queue.appendleft(msg)
