"""Lint of /metrics: Prometheus naming (DESIGN §6), units, ratio ranges, and promtool.

The catalog is checked by its declarations; then a run with everything switched on
(warm-up, padding, HFU, a profiler breakdown, a straggler flag from the real detector) is
stored through the real ingest path, ``/metrics`` is fetched from the app, and the
exposition is checked sample by sample and by ``promtool check metrics``.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from stepwatch_server.analysis.stragglers import StragglerDetector
from stepwatch_server.app import create_app
from stepwatch_server.exporter.catalog import FAMILIES, exposed_names
from stepwatch_server.exporter.registry import CollectorMetrics
from stepwatch_server.settings import Settings
from stepwatch_server.storage import migrate

from .payloads import CONVENTION
from .runstate import detect_stragglers, fill_breakdown, store

NON_BASE_UNITS = re.compile(
    r"_(ms|milliseconds|us|microseconds|minutes|hours|days|percent|pct|[kmg]i?b)(_|$)"
)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_catalog_names_follow_the_conventions(family: object) -> None:
    from stepwatch_server.exporter.catalog import Family

    assert isinstance(family, Family)
    name = family.name
    assert re.fullmatch(r"stepwatch_[a-z][a-z0-9_]*", name)
    assert not NON_BASE_UNITS.search(name), f"{name}: use base units (seconds, ratio 0-1)"
    assert name.endswith("_total") == (family.kind == "counter"), name
    assert name.endswith("_info") == (family.kind == "info"), name
    if family.unit == "ratio":
        assert "0-1" in family.help, f"{name}: say the range in the help"
    if "seconds" in name:
        assert family.unit == "seconds" and name.endswith("_seconds"), name
    if family.scope != "global" and family.scope != "global_enum":
        assert family.labels[0] == "run", name
    if family.scope in ("rank", "flagged"):
        assert family.labels[:4] == ("run", "rank", "Hostname", "gpu"), name  # dcgm-exporter's names
    assert family.help.endswith("."), name


@pytest.fixture(scope="module")
def exposition(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('lint') / 'lint.db'}"
    migrate.upgrade(url)
    app = create_app(Settings(database_url=url, window_seconds=1.0, metrics_top_k=2))
    engine = app.state.engine
    detector = StragglerDetector("lint")
    conv = {**CONVENTION, "hfu_flops_per_token": 1.3e9}
    for w in range(6):
        for rank in range(8):
            store(
                app.state.ingestor,
                run="lint",
                rank=rank,
                world=8,
                first=1 + 4 * w,
                times=[0.25] * 4,
                waits=[0.01 * (rank == 4)] * 4,
                tokens=[900] * 4,
                padded=[1024] * 4,
                tags=["warmup"] * 4 if w == 0 else (["checkpoint", None, None, None] if w == 3 else None),
                convention=conv,
            )
        fill_breakdown(
            engine, "lint", window=w, compute=lambda r: 0.15 if r == 6 else 0.1, comm_wait=lambda r: 0.05
        )
        detect_stragglers(engine, detector, w)
    with TestClient(app) as client:
        r = client.get("/metrics")
    assert r.status_code == 200
    return r.text


def test_promtool_accepts_the_exposition(exposition: str, tmp_path: Path) -> None:
    r = subprocess.run(
        ["promtool", "check", "metrics"], input=exposition, capture_output=True, text=True, timeout=60
    )
    assert (r.returncode, r.stdout + r.stderr) == (0, "")


def test_every_sample_is_declared_in_range_and_labelled_as_declared(exposition: str) -> None:
    declared = {n: f for f in FAMILIES for n in exposed_names(f)}
    own = {m.name for m in CollectorMetrics().registry.collect()}
    seen: set[str] = set()
    for fam in text_string_to_metric_families(exposition):
        if fam.name.removesuffix("_created") in own:  # the app's ingest counters (and their _created)
            continue
        for s in fam.samples:
            f = declared.get(s.name)
            assert f is not None, f"{s.name} is exported but not in the catalog"
            seen.add(f.name)
            allowed = set(f.labels) | ({"quantile"} if f.kind == "summary" else set())
            if f.kind == "info":
                allowed |= {"convention", "formula", "dtype", "device", "peak_source"}
            assert set(s.labels) <= allowed, (s.name, s.labels)
            assert s.value == s.value, f"{s.name} is NaN"
            if f.unit == "ratio":
                assert 0.0 <= s.value <= 1.0, (s.name, s.labels, s.value)
            assert s.value >= 0, (s.name, s.labels, s.value)
            if s.name.endswith("_timestamp_seconds"):
                assert s.value > 1.5e9, (s.name, s.value)
    assert seen == {f.name for f in FAMILIES}, f"not exercised: {sorted({f.name for f in FAMILIES} - seen)}"


def test_quantiles_across_ranks_are_ordered(exposition: str) -> None:
    for fam in text_string_to_metric_families(exposition):
        if fam.type != "summary" or not fam.name.startswith("stepwatch_run_rank_"):
            continue
        qs = sorted((float(s.labels["quantile"]), s.value) for s in fam.samples if "quantile" in s.labels)
        assert [v for _, v in qs] == sorted(v for _, v in qs), fam.name
