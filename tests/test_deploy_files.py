"""docker-compose.yml and everything it mounts, validated statically.

No Docker engine runs here: Debian's ``docker-compose`` (v1) validates and resolves the
file (``config``), and each mounted configuration is checked by its own tool
(``promtool check config``, ``amtool check-config``) or parsed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from dashboards.config import DEFAULT

ROOT = Path(__file__).resolve().parents[1]
ENV = {"STEPWATCH_DB_PASSWORD": "not-a-secret", "GRAFANA_ADMIN_PASSWORD": "not-a-secret"}
LONG_RUNNING = {"postgres", "collector", "prometheus", "alertmanager", "grafana"}


def compose(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ENV}
    return subprocess.run(
        ["docker-compose", "-f", str(ROOT / "docker-compose.yml"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**base, **(env or {})},
        cwd=ROOT,
    )


@pytest.fixture(scope="module")
def resolved() -> dict[str, Any]:
    r = compose("config", env=ENV)
    assert r.returncode == 0, r.stderr
    data: dict[str, Any] = yaml.safe_load(r.stdout)
    return data


def mounts(resolved: dict[str, Any], service: str) -> dict[str, Path]:
    """Container path -> host path of the service's bind mounts."""
    out = {}
    for v in resolved["services"][service].get("volumes", []):
        source, target = v.split(":")[:2]
        if source.startswith("/"):
            out[target] = Path(source)
    return out


def test_secrets_must_come_from_the_environment() -> None:
    r = compose("config", env={})
    assert r.returncode != 0 and "STEPWATCH_DB_PASSWORD" in r.stderr
    raw = (ROOT / "docker-compose.yml").read_text()
    for key, value in re.findall(r"^\s*([A-Z_]*(?:PASSWORD|SECRET|TOKEN)[A-Z_]*):\s*(.+)$", raw, re.M):
        assert value.strip().startswith("${"), f"{key} has a literal value"
    for url in re.findall(r"postgresql://\S+", raw):
        assert re.match(r"postgresql://[^:]+:\$\{", url), f"password literal in {url}"


def test_grafana_is_not_open_to_anonymous_viewers_by_default(resolved: dict[str, Any]) -> None:
    env = resolved["services"]["grafana"]["environment"]
    assert str(env["GF_AUTH_ANONYMOUS_ENABLED"]).lower() == "false"
    opened = compose("config", env={**ENV, "GRAFANA_ANONYMOUS_VIEWER": "true"})
    assert opened.returncode == 0, opened.stderr
    assert (
        yaml.safe_load(opened.stdout)["services"]["grafana"]["environment"]["GF_AUTH_ANONYMOUS_ENABLED"]
        == "true"
    )


def test_the_collector_image_keeps_its_sqlite_file_where_its_user_may_write() -> None:
    text = (ROOT / "docker" / "Dockerfile").read_text()
    (user,) = re.findall(r"^USER (\S+)$", text, re.M)
    (url,) = re.findall(r"^ENV STEPWATCH_DATABASE_URL=sqlite:///(\S+)$", text, re.M)
    directory = str(Path(url).parent)
    assert directory not in ("/app", "."), url  # WORKDIR belongs to root
    assert re.search(rf"^RUN .*mkdir -p {re.escape(directory)} && chown {user}\b", text, re.M), text


def test_services_are_pinned_healthchecked_and_ordered(resolved: dict[str, Any]) -> None:
    services = resolved["services"]
    assert set(services) == LONG_RUNNING | {"migrate"}
    for name, svc in services.items():
        image = svc["image"]
        tag = image.rsplit(":", 1)[1] if ":" in image.split("/")[-1] else ""
        assert re.search(r"\d+\.\d+", tag), f"{name}: pin an exact version, not {image!r}"
        for dep, cond in svc.get("depends_on", {}).items():
            assert cond["condition"] in {"service_healthy", "service_completed_successfully"}, (name, dep)
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep}, which has no healthcheck"
    for name in LONG_RUNNING:
        assert services[name].get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
    assert services["migrate"]["restart"] == "no"
    assert services["collector"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    from_line = next(
        ln for ln in (ROOT / "docker" / "Dockerfile").read_text().splitlines() if ln.startswith("FROM")
    )
    assert re.search(r":\d+\.\d+\.\d+", from_line), from_line


def test_every_mounted_file_exists_and_parses(resolved: dict[str, Any]) -> None:
    checked = 0
    for name in resolved["services"]:
        for host in mounts(resolved, name).values():
            assert host.exists(), f"{name} mounts {host}, which does not exist"
            for f in [host] if host.is_file() else sorted(p for p in host.rglob("*") if p.is_file()):
                if f.suffix in (".yml", ".yaml"):
                    assert yaml.safe_load(f.read_text()) is not None, f
                elif f.suffix == ".json":
                    json.loads(f.read_text())
                checked += 1
    for secret in resolved.get("secrets", {}).values():
        assert Path(secret["file"]).is_file(), secret
    assert checked >= 9


def test_prometheus_config_loads_the_rules_it_mounts(resolved: dict[str, Any], tmp_path: Path) -> None:
    m = mounts(resolved, "prometheus")
    cfg = yaml.safe_load(m["/etc/prometheus/prometheus.yml"].read_text())
    cfg["rule_files"] = [str(m[p]) for p in cfg["rule_files"]]  # container paths -> the mounted files
    assert [j["job_name"] for j in cfg["scrape_configs"]] == [DEFAULT.job]
    local = tmp_path / "prometheus.yml"
    local.write_text(yaml.safe_dump(cfg))
    r = subprocess.run(
        ["promtool", "check", "config", str(local)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_alertmanager_config_passes_amtool(resolved: dict[str, Any]) -> None:
    m = mounts(resolved, "alertmanager")
    path = m["/etc/alertmanager/alertmanager.yml"]
    r = subprocess.run(["amtool", "check-config", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    cfg = yaml.safe_load(path.read_text())
    secret = resolved["services"]["alertmanager"]["secrets"][0]["source"]
    files = {s["api_url_file"] for rcv in cfg["receivers"] for s in rcv.get("slack_configs", [])}
    assert files == {f"/run/secrets/{secret}"}  # the webhook URL is the compose secret, not in the file


def test_grafana_provisioning_points_at_the_generated_dashboards(resolved: dict[str, Any]) -> None:
    m = mounts(resolved, "grafana")
    ds = yaml.safe_load((m["/etc/grafana/provisioning/datasources"] / "stepwatch.yml").read_text())
    (source,) = ds["datasources"]
    assert source["uid"] == DEFAULT.datasource_uid and source["type"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"
    prov = yaml.safe_load((m["/etc/grafana/provisioning/dashboards"] / "stepwatch.yml").read_text())
    (provider,) = prov["providers"]
    assert provider["allowUiUpdates"] is False and provider["disableDeletion"] is True
    dashboards = m[provider["options"]["path"]]
    assert sorted(p.name for p in dashboards.glob("*.json")) == sorted(
        p.name for p in (ROOT / "dashboards" / "grafana" / "dashboards").glob("*.json")
    )
    home = resolved["services"]["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (dashboards / Path(home).name).is_file() and home.startswith(provider["options"]["path"])
