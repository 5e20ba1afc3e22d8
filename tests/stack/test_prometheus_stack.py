"""The monitoring stack for real: collector -> Prometheus -> rules -> Alertmanager -> Slack hook.

A real collector (uvicorn on loopback, PostgreSQL) receives ingest payloads built by the
agent's own code for two runs: 16 ranks on two hosts, with rank 11 computing 50% longer
than its peers (a compute straggler), and a 4-rank run beside it. What this work stream
does not own is stood in for, in the shape its owners write it:
- the profiler breakdown columns of each window (the profiler-window work fills them),
- the straggler events: the real detector (``stepwatch_server.analysis.stragglers``)
  runs over the stored windows and the test stores its findings, as the collector's
  detection wiring will once it is merged.
A real Prometheus scrapes the collector every second and evaluates the generated rules
(with every ``for:`` shortened to 1 s); a real Alertmanager with the repository's config
(group waits shortened, the Slack URL pointed at a local sink) routes the alerts.

Asserted: every query of every dashboard panel, annotation and variable returns data
through Prometheus's HTTP API; the straggler alert fires for rank 11 with the detector's
cost; Alertmanager delivers it to the Slack hook. Set STEPWATCH_STACK_REPORT=path to write
the series each panel showed (the closing note of the issue quotes it).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import yaml
from sqlalchemy import Engine

from dashboards import generate
from dashboards.config import DEFAULT, Config
from stepwatch_server.analysis.stragglers import StragglerDetector
from stepwatch_server.storage import migrate
from stepwatch_server.storage.engine import make_engine

from .. import pg
from ..live import serve_in_thread
from ..payloads import payload
from ..runstate import detect_stragglers, fill_breakdown
from ..wait import wait_until
from .servers import alertmanager, prometheus, webhook_sink

ROOT = Path(__file__).resolve().parents[2]
RUN, OTHER = "stack-a", "stack-b"
STRAGGLER = 11
VARIABLES = {"run": RUN, "rank": ".*", "target_tokens": "1e12"}
T = TypeVar("T")


class Feeder(threading.Thread):
    """Posts one window of 4 steps per rank every half second, like agents would."""

    def __init__(self, url: str, engine: Engine) -> None:
        super().__init__(daemon=True)
        self.url, self.engine = url, engine
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.detector = StragglerDetector(RUN)
        self.flags: list[str] = []

    def run(self) -> None:
        try:
            with httpx.Client(base_url=self.url, timeout=10) as client:
                window = 0
                while not self.stop.is_set():
                    self.round(client, window)
                    window += 1
                    self.stop.wait(0.5)
        except BaseException as exc:  # surfaced by the test
            self.error = exc

    def round(self, client: httpx.Client, w: int) -> None:
        tags = ["warmup"] * 4 if w == 0 else None
        for run, world in ((RUN, 16), (OTHER, 4)):
            for rank in range(world):
                p = payload(
                    run=run,
                    rank=rank,
                    world=world,
                    first=1 + 4 * w,
                    times=[0.25] * 4,
                    waits=[0.004 if rank == 3 else 0.001] * 4,
                    tokens=[2048] * 4,
                    padded=[2304] * 4,
                    tags=tags,
                )
                r = client.post("/api/v1/ingest", json=p)
                r.raise_for_status()
        # Stand-in for the profiler window: rank 11 computes longer and waits less.
        fill_breakdown(
            self.engine,
            RUN,
            window=w,
            compute=lambda r: 0.15 if r == STRAGGLER else 0.10,
            comm_wait=lambda r: 0.005 if r == STRAGGLER else 0.055,
        )
        fill_breakdown(self.engine, OTHER, window=w, compute=lambda r: 0.10, comm_wait=lambda r: 0.05)
        # Stand-in for the detection wiring: the real detector over the stored window.
        self.flags += [f.key for f in detect_stragglers(self.engine, self.detector, w) if f.status == "open"]


def substitute(expr: str) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: VARIABLES[m.group(1)], expr)


Query = tuple[str, str, str, str, bool]


def queries() -> Iterator[Query]:
    """(dashboard, panel or annotation, refId, expr, instant) for all the dashboards query."""
    for path in sorted((ROOT / "dashboards" / "grafana" / "dashboards").glob("*.json")):
        model = json.loads(path.read_text())
        for p in model["panels"]:
            for t in p.get("targets", []):
                yield path.stem, f"{p['id']}: {p['title']}", t["refId"], t["expr"], bool(t.get("instant"))
        for ann in model.get("annotations", {}).get("list", []):
            yield path.stem, f"annotation: {ann['name']}", "", ann["expr"], False


def evaluate(prom: httpx.Client, expr: str, instant: bool) -> list[dict[str, Any]]:
    """Series the query returns with at least one value: labels and the newest value."""
    now = time.time()
    if instant:
        r = prom.get("/api/v1/query", params={"query": substitute(expr), "time": now})
    else:
        params = {"query": substitute(expr), "start": now - 120, "end": now, "step": 1}
        r = prom.get("/api/v1/query_range", params=params)
    r.raise_for_status()
    out = []
    for s in r.json()["data"]["result"]:
        newest = s["values"][-1] if s.get("values") else s.get("value")
        if newest:
            out.append({"labels": s["metric"], "value": newest[1]})
    return out


def firing(prom: httpx.Client, alertname: str) -> list[dict[str, Any]]:
    alerts = prom.get("/api/v1/alerts").json()["data"]["alerts"]
    return [a for a in alerts if a["labels"]["alertname"] == alertname and a["state"] == "firing"]


def short_rules(path: Path) -> Path:
    """The generated rules with every ``for:`` cut to 1 s (a test-specific rule file)."""
    cfg = Config(for_=dict.fromkeys(DEFAULT.for_, "1s"))
    path.write_text(generate.render_rules(cfg))
    return path


def alertmanager_config(sink_url: str, secret: Path) -> dict[str, Any]:
    """The repository's Alertmanager config, with fast grouping and the hook pointed here."""
    cfg: dict[str, Any] = yaml.safe_load(
        (ROOT / "dashboards" / "alertmanager" / "alertmanager.yml").read_text()
    )
    secret.write_text(sink_url)
    cfg["route"].update(group_wait="1s", group_interval="1s")
    for receiver in cfg["receivers"]:
        for slack in receiver.get("slack_configs", []):
            slack["api_url_file"] = str(secret)
    return cfg


@pytest.fixture
def database(pg_admin: str) -> Iterator[str]:
    with pg.fresh_database(pg_admin) as url:
        migrate.upgrade(url)
        yield url


def test_dashboards_rules_and_alerts_against_a_real_prometheus(database: str, tmp_path: Path) -> None:
    engine = make_engine(database)
    feeder: Feeder | None = None
    try:
        with (
            serve_in_thread(database, window_seconds=1.0, metrics_top_k=4) as collector,
            webhook_sink() as (sink_url, sink),
            alertmanager(tmp_path, alertmanager_config(sink_url, tmp_path / "slack_url")) as am,
            prometheus(
                tmp_path,
                scrape=collector.removeprefix("http://"),
                rules=short_rules(tmp_path / "rules.yml"),
                alertmanager=am.removeprefix("http://"),
            ) as prom_url,
            httpx.Client(base_url=prom_url, timeout=10) as prom,
        ):
            feeder = Feeder(collector, engine)
            feeder.start()

            # The straggler alert fires in Prometheus for rank 11, with the detector's cost.
            alerts = wait_until(
                lambda: firing(prom, "StepwatchStragglerPersisting"),
                "StepwatchStragglerPersisting to fire",
                timeout_s=40,
                every_s=0.5,
            )
            assert feeder.error is None, feeder.error
            assert feeder.flags == [f"straggler:compute:rank={STRAGGLER}"]
            labels = alerts[0]["labels"]
            assert (labels["run"], labels["rank"], labels["Hostname"], labels["gpu"], labels["cause"]) == (
                RUN,
                str(STRAGGLER),
                "node1",
                "3",
                "compute",
            )
            assert float(alerts[0]["value"]) == pytest.approx(0.05 / 0.25, rel=0.05)
            assert "Rank 11 (node1, GPU 3)" in alerts[0]["annotations"]["summary"]
            quiet = {a["labels"]["alertname"] for a in prom.get("/api/v1/alerts").json()["data"]["alerts"]}
            assert quiet == {"StepwatchStragglerPersisting"}, "only the injected fault may alert"

            # Every panel, annotation and variable of every dashboard returns data.
            shown: dict[Query, list[dict[str, Any]]] = {}

            def all_have_data() -> bool:
                for query in queries():
                    if not shown.get(query):
                        shown[query] = evaluate(prom, query[3], query[4])
                return all(shown.values())

            try:
                wait_until(all_have_data, "every dashboard query to return data", timeout_s=30, every_s=0.5)
            except AssertionError:
                empty = [f"{d} / {p} / {ref}: {e}" for (d, p, ref, e, _), s in shown.items() if not s]
                raise AssertionError("queries without data:\n" + "\n".join(empty)) from None
            expected = list(queries())
            assert len(shown) == len(expected) > 50  # every panel of the four dashboards was asked
            assert {q[0] for q in expected} == {
                "stepwatch-run",
                "stepwatch-breakdown",
                "stepwatch-ranks",
                "stepwatch-fleet",
            }
            runs = prom.get("/api/v1/label/run/values", params={"match[]": "stepwatch_run_info"}).json()[
                "data"
            ]
            assert {RUN, OTHER} <= set(runs)
            ranks = prom.get(
                "/api/v1/label/rank/values",
                params={"match[]": f'stepwatch_rank_step_time_seconds{{run="{RUN}"}}'},
            ).json()["data"]
            assert str(STRAGGLER) in ranks and len(ranks) <= 4 + 16  # top-K + flagged, not all 16

            # Alertmanager routes it with the repository's config to the Slack hook.
            def delivered() -> list[dict[str, Any]]:
                return [b for b in sink.received() if "StepwatchStragglerPersisting" in json.dumps(b)]

            bodies = wait_until(
                delivered,
                "Alertmanager to post the alert to the Slack hook",
                timeout_s=20,
                every_s=0.5,
            )
            assert bodies[0]["channel"] == "#training-alerts"  # a warning: the team channel
            assert "Rank 11 (node1, GPU 3) of run stack-a is a compute straggler" in json.dumps(bodies[0])

            report = os.environ.get("STEPWATCH_STACK_REPORT")
            if report:
                Path(report).write_text(
                    json.dumps(
                        [
                            {"dashboard": d, "panel": p, "ref": ref, "expr": e, "series": s}
                            for (d, p, ref, e, _), s in shown.items()
                        ],
                        indent=1,
                    )
                )
            assert feeder.error is None, feeder.error
    finally:
        if feeder is not None:
            feeder.stop.set()
            feeder.join(10)
        engine.dispose()
