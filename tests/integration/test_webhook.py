"""The webhook against a real HTTP receiver on loopback: formats, retries, never blocking."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from stepwatch.demo.launch import free_port
from stepwatch_server.analysis.types import Finding
from stepwatch_server.app import create_app
from stepwatch_server.settings import Settings
from stepwatch_server.worker.webhook import WebhookNotifier

from ..payloads import payload
from ..wait import wait_until


class Receiver:
    """Records every POST; answers the scripted statuses in order, then 200."""

    def __init__(self, statuses: list[int] | None = None) -> None:
        self.statuses = list(statuses or [])
        self.bodies: list[Any] = []
        self.answered: list[int] = []
        self.release = threading.Event()
        self.release.set()
        self.lock = threading.Lock()

    def handler(self) -> type[BaseHTTPRequestHandler]:
        rec = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                rec.release.wait(30)
                with rec.lock:
                    status = rec.statuses.pop(0) if rec.statuses else 200
                    rec.bodies.append(json.loads(body))
                    rec.answered.append(status)
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        return Handler


@contextmanager
def receiving(rec: Receiver) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), rec.handler())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook"
    finally:
        rec.release.set()
        server.shutdown()
        server.server_close()


FINDING = Finding(
    kind="straggler",
    run="r",
    key="straggler:compute:rank=2",
    cause="compute",
    ranks=(2,),
    hosts=("node0",),
    first_step=41_200,
    last_step=41_260,
    status="open",
    evidence={"compute_s": 1.3},
    cost_seconds=0.2,
    cost_ratio=0.1,
    message="Rank 2 (host node0) is a compute straggler since step 41,200.",
)


def test_slack_body_is_delivered_after_transient_failures() -> None:
    rec = Receiver([500, 503])
    with receiving(rec) as url:
        n = WebhookNotifier(url, fmt="slack", backoff_base_s=0.02, backoff_max_s=0.05)
        n.start()
        n.notify("r", FINDING)
        wait_until(lambda: n.stats.delivered == 1, "n.stats.delivered == 1")
        n.close()
    assert rec.answered == [500, 503, 200] and n.stats.attempts == 3 and n.stats.failed == 0
    assert rec.bodies[-1] == {"text": f"[stepwatch] run r: straggler open. {FINDING.message}"}


def test_a_permanent_rejection_is_not_retried_and_a_dead_receiver_is_given_up() -> None:
    rec = Receiver([400])
    with receiving(rec) as url:
        n = WebhookNotifier(url, backoff_base_s=0.01)
        n.start()
        n.notify("r", FINDING)
        wait_until(lambda: n.stats.failed == 1, "n.stats.failed == 1")
        n.close()
    assert rec.answered == [400]
    gone = WebhookNotifier("http://127.0.0.1:9/hook", max_attempts=3, backoff_base_s=0.01, timeout_s=1.0)
    gone.start()
    gone.notify("r", FINDING)
    wait_until(lambda: gone.stats.failed == 1, "gone.stats.failed == 1")
    gone.close()
    assert gone.stats.attempts == 3 and gone.stats.delivered == 0


def test_alertmanager_alerts_fire_are_resent_and_resolve() -> None:
    rec = Receiver()
    with receiving(rec) as url:
        n = WebhookNotifier(url, fmt="alertmanager", resend_s=0.2, public_url="http://collector:8321/")
        n.start()
        n.notify("r", FINDING)
        wait_until(lambda: len(rec.bodies) >= 2, "len(rec.bodies) >= 2")  # the firing alert, then a re-send
        n.notify("r", replace(FINDING, status="closed"))
        wait_until(
            lambda: any("endsAt" in a for body in rec.bodies for a in body),
            "the resolved alert",
        )
        n.close()
    fired = rec.bodies[0]
    assert isinstance(fired, list) and len(fired) == 1
    alert = fired[0]
    assert alert["labels"] == {
        "alertname": "StepwatchStraggler",
        "source": "stepwatch",
        "run": "r",
        "key": "straggler:compute:rank=2",
        "kind": "straggler",
        "severity": "warning",
        "cause": "compute",
    }
    assert alert["annotations"]["summary"] == FINDING.message
    assert alert["annotations"]["ranks"] == "2" and alert["annotations"]["first_step"] == "41200"
    assert alert["generatorURL"] == "http://collector:8321/api/v1/runs/r/events"
    assert alert["startsAt"].endswith("Z") and "endsAt" not in alert
    assert rec.bodies[1] == fired  # re-sent while firing (Alertmanager would resolve it otherwise)
    resolved = next(a for body in rec.bodies for a in body if "endsAt" in a)
    assert resolved["labels"] == alert["labels"] and resolved["startsAt"] == alert["startsAt"]


def test_notify_never_waits_for_the_receiver() -> None:
    rec = Receiver()
    rec.release.clear()  # the receiver holds every request until released
    with receiving(rec) as url:
        n = WebhookNotifier(url, max_queue=3)
        n.start()
        done = threading.Event()

        def burst() -> None:
            for i in range(10):
                n.notify("r", replace(FINDING, first_step=i))
            done.set()

        threading.Thread(target=burst, daemon=True).start()
        assert done.wait(5), "notify blocked on a stuck receiver"
        assert n.stats.dropped >= 6  # bounded queue: the oldest are dropped and counted
        rec.release.set()
        wait_until(lambda: n.stats.delivered >= 1, "n.stats.delivered >= 1")
        n.close()


def test_the_collector_notifies_when_its_worker_flags(tmp_path: Path) -> None:
    """Through the app: STEPWATCH_WEBHOOK_URL set, a data straggler found by the worker."""
    from stepwatch_server.storage import migrate

    db = f"sqlite:///{tmp_path / 'w.db'}"
    migrate.upgrade(db)
    rec = Receiver()
    with receiving(rec) as url:
        settings = Settings(database_url=db, window_seconds=4.0, analysis_enabled=False, webhook_url=url)
        app = create_app(settings)
        with TestClient(app) as c:
            for w in range(8):
                for r in range(8):
                    waits = [0.001 + (0.1 if r == 3 and w >= 2 else 0.0)] * 8
                    assert c.post(
                        "/api/v1/ingest",
                        json=payload(rank=r, world=8, first=w * 8 + 1, times=[0.5] * 8, waits=waits),
                    ).is_success
            app.state.worker.run_once()
            wait_until(lambda: len(rec.bodies) == 1, "len(rec.bodies) == 1")
            metrics = c.get("/metrics").text
    assert "straggler:data:rank=3" not in rec.bodies[0]["text"]  # people read the message, not keys
    assert rec.bodies[0]["text"].startswith("[stepwatch] run test-run: straggler open. Rank 3 (host node0)")
    assert 'stepwatch_webhook_notifications_total{outcome="delivered"} 1.0' in metrics
    assert 'stepwatch_event_transitions_total{kind="straggler",status="open"} 1.0' in metrics


ALERTMANAGER = "prometheus-alertmanager"


@contextmanager
def alertmanager(tmp_path: Path) -> Iterator[str]:
    """A real Alertmanager (Debian: apt-get install prometheus-alertmanager) on loopback."""
    binary = shutil.which(ALERTMANAGER) or shutil.which("alertmanager")
    if binary is None:
        pytest.fail(f"{ALERTMANAGER} not found: apt-get install -y prometheus-alertmanager", pytrace=False)
    cfg = tmp_path / "am.yml"
    cfg.write_text("route:\n  receiver: blackhole\nreceivers:\n  - name: blackhole\n")
    port = free_port()
    cmd = [
        binary,
        f"--config.file={cfg}",
        f"--storage.path={tmp_path / 'am'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--cluster.listen-address=",
    ]
    with open(tmp_path / "am.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _ready(url, proc), "Alertmanager to be ready", timeout_s=20)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def _ready(url: str, proc: subprocess.Popen[bytes]) -> bool:
    assert proc.poll() is None, "alertmanager exited"
    try:
        return httpx.get(f"{url}/-/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_real_alertmanager_takes_the_alert_and_resolves_it(tmp_path: Path) -> None:
    with alertmanager(tmp_path) as am:
        n = WebhookNotifier(f"{am}/api/v2/alerts", fmt="alertmanager", backoff_base_s=0.05)
        n.start()
        n.notify("llama-8b", FINDING)
        wait_until(lambda: n.stats.delivered == 1, "n.stats.delivered == 1")

        def active() -> list[dict[str, Any]]:
            alerts: list[dict[str, Any]] = httpx.get(f"{am}/api/v2/alerts", params={"active": "true"}).json()
            return [a for a in alerts if a["labels"].get("source") == "stepwatch"]

        wait_until(lambda: len(active()) == 1, "len(active()) == 1")
        (alert,) = active()
        assert alert["labels"]["alertname"] == "StepwatchStraggler" and alert["labels"]["run"] == "llama-8b"
        assert alert["annotations"]["summary"] == FINDING.message
        assert alert["status"]["state"] == "active"
        n.notify("llama-8b", replace(FINDING, status="closed"))
        wait_until(lambda: n.stats.delivered == 2, "n.stats.delivered == 2")
        wait_until(lambda: active() == [], "active() == []")  # endsAt now: Alertmanager resolved it
        n.close()
        assert n.stats.failed == 0
