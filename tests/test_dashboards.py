"""Dashboards and rules as code: no drift from the generator, valid structure, valid rules.

Grafana itself cannot run here (no server is obtainable), so the dashboards are checked
structurally (and decoded with grafana-foundation-sdk); every query is evaluated against a
real Prometheus in ``tests/stack``.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models.dashboard import Dashboard as DashboardModel

from dashboards import generate
from dashboards.config import DEFAULT
from dashboards.grafana import BUILDERS
from stepwatch_server.exporter.catalog import FAMILIES, exposed_names

ROOT = Path(__file__).resolve().parents[1]
DASH = ROOT / "dashboards"
GRAFANA = DASH / "grafana" / "dashboards"
JSONS = sorted(GRAFANA.glob("*.json"))
RULES = DASH / "prometheus" / "stepwatch.rules.yml"
RULE_TESTS = DASH / "prometheus" / "tests" / "alerts_test.yml"


def load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _pruned(value: Any) -> Any:
    """Without empty objects (the SDK decodes an absent ``custom`` as ``{}``)."""
    if isinstance(value, dict):
        return {k: _pruned(v) for k, v in value.items() if v != {}}
    if isinstance(value, list):
        return [_pruned(v) for v in value]
    return value


def targets(model: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(panel title, target) for every query of every panel."""
    return [(p["title"], t) for p in model["panels"] for t in p.get("targets", [])]


def test_committed_files_match_the_generator() -> None:
    assert generate.drifted() == [], "regenerate with: python -m dashboards.generate"


def test_drift_is_detected(tmp_path: Path) -> None:
    generate.write(tmp_path)
    assert generate.drifted(tmp_path) == []
    victim = tmp_path / "grafana" / "dashboards" / "stepwatch-run.json"
    victim.write_text(victim.read_text().replace("MFU", "Mfu", 1))
    (tmp_path / "grafana" / "dashboards" / "stray.json").write_text("{}")
    assert set(generate.drifted(tmp_path)) == {
        Path("grafana/dashboards/stepwatch-run.json"),
        Path("grafana/dashboards/stray.json"),
    }


def test_one_file_per_dashboard() -> None:
    assert [p.stem for p in JSONS] == sorted(BUILDERS)


@pytest.mark.parametrize("path", JSONS, ids=lambda p: p.stem)
def test_dashboard_decodes_with_the_sdk(path: Path) -> None:
    register_default_plugins()
    model = load(path)
    decoded = DashboardModel.from_json(model)
    again = json.loads(JSONEncoder(sort_keys=True).encode(decoded))
    # Prometheus annotation formats are the only fields the SDK does not model.
    for ann in model.get("annotations", {}).get("list", []):
        for key in ("titleFormat", "textFormat", "tagKeys", "step"):
            ann.pop(key, None)
    assert _pruned(again) == _pruned(model)


@pytest.mark.parametrize("path", JSONS, ids=lambda p: p.stem)
def test_dashboard_structure(path: Path) -> None:
    model = load(path)
    assert model["uid"] == path.stem and model["editable"] is False
    assert "stepwatch" in model["tags"]
    variables = {v["name"]: v for v in model["templating"]["list"]}
    assert variables["datasource"]["current"]["value"] == DEFAULT.datasource_uid
    if path.stem != "stepwatch-fleet":
        assert "run" in variables
    if path.stem == "stepwatch-ranks":
        assert variables["rank"]["includeAll"] and variables["rank"]["multi"]
    ids = [p["id"] for p in model["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in model["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        mine = {(g["x"] + i, g["y"] + j) for i in range(g["w"]) for j in range(g["h"])}
        assert not cells & mine, f"{p['title']} overlaps another panel"
        cells |= mine
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert p.get("targets"), f"{p['title']} has no query"
            assert p.get("description"), f"{p['title']} has no description"
            refs = [t["refId"] for t in p["targets"]]
            assert len(refs) == len(set(refs)), p["title"]
    used = set()
    for title, t in targets(model):
        used |= set(re.findall(r"\$(\w+)", t["expr"] + title))
    for ann in model.get("annotations", {}).get("list", []):
        used |= set(re.findall(r"\$(\w+)", ann["expr"]))
    assert used <= set(variables), f"undefined variables {used - set(variables)}"


def test_the_fleet_table_links_each_run_to_its_overview() -> None:
    fleet = load(GRAFANA / "stepwatch-fleet.json")
    (runs,) = [p for p in fleet["panels"] if p["title"] == "Runs"]
    (override,) = [o for o in runs["fieldConfig"]["overrides"] if o["matcher"]["options"] == "run"]
    (links,) = [p["value"] for p in override["properties"] if p["id"] == "links"]
    assert links[0]["url"].startswith("/d/stepwatch-run/?var-run=${__value.raw}")
    assert "stepwatch-run" in {path.stem for path in JSONS}


def test_the_run_picker_outlives_the_metrics_expiry() -> None:
    """/metrics drops a run an hour after its last batch; the picker still offers it."""
    model = load(GRAFANA / "stepwatch-run.json")
    (run,) = [v for v in model["templating"]["list"] if v["name"] == "run"]
    query = run["query"] if isinstance(run["query"], str) else run["query"]["query"]
    assert not query.startswith("label_values(")  # bound to the dashboard's time range
    (days,) = re.findall(r"\[(\d+)d\]", query)
    assert int(days) >= 7


def _metric_names(expr: str) -> set[str]:
    names = set(re.findall(r"\b(stepwatch_[a-z_]+|run(?:_phase)?:stepwatch_[a-z_]+:[a-z0-9_]+)\b", expr))
    return names


def test_every_query_uses_exported_or_recorded_series() -> None:
    exported = {n for f in FAMILIES for n in exposed_names(f)}
    rules = yaml.safe_load(RULES.read_text())
    recorded = {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    exprs = [t["expr"] for path in JSONS for _, t in targets(load(path))]
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    unknown = set().union(*(_metric_names(e) for e in exprs)) - exported - recorded
    assert not unknown, f"queries use series nobody exports: {sorted(unknown)}"


def test_rules_pass_promtool() -> None:
    r = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run(
        ["promtool", "test", "rules", str(RULE_TESTS)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_alerts_follow_the_mixin_conventions() -> None:
    rules = yaml.safe_load(RULES.read_text())
    alerts = [r for g in rules["groups"] for r in g["rules"] if "alert" in r]
    runbook = (DASH / "RUNBOOK.md").read_text()
    for a in alerts:
        assert a["labels"]["severity"] in {"warning", "critical"}, a["alert"]
        assert set(a["annotations"]) == {"summary", "description", "runbook_url"}, a["alert"]
        assert a["annotations"]["runbook_url"].endswith("#" + a["alert"].lower())
        assert f"## {a['alert']}\n" in runbook, f"RUNBOOK.md has no section for {a['alert']}"
        assert a["for"] == DEFAULT.for_[a["alert"]]
    assert {a["alert"] for a in alerts} == set(DEFAULT.for_)


def test_every_alert_is_tested_on_both_sides_of_its_for() -> None:
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    quiet: set[str] = set()
    firing: set[str] = set()
    for t in tests:
        for case in t.get("alert_rule_test", []):
            (firing if case["exp_alerts"] else quiet).add(case["alertname"])
    assert quiet >= set(DEFAULT.for_) and firing >= set(DEFAULT.for_)
