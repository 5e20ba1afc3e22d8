"""No input can push /metrics past its configured series bound.

A flood of run names, a run with many ranks and a storm of straggler flags go into a real
database through the real ingest path; the exposition is parsed back and its series
counted. The bound comes from the catalog (``series_bound``), not from this test.
"""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine

from stepwatch_server.exporter import ExporterConfig, RunStateCollector
from stepwatch_server.exporter.catalog import series_per_run
from stepwatch_server.ingest.store import Ingestor
from stepwatch_server.storage.backend import open_storage

from ..runstate import feed, fill_breakdown, open_straggler


def series(reg: CollectorRegistry) -> list[tuple[str, dict[str, str], float]]:
    text = generate_latest(reg).decode()
    return [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]


def test_a_flood_of_runs_ranks_and_flags_stays_within_the_bound(engine: Engine) -> None:
    rng = random.Random(5)
    ingestor = Ingestor(open_storage(engine), window_seconds=2.0)
    cfg = ExporterConfig(max_runs=5, top_k=3, max_flagged=4)
    names = [f"flood-{rng.getrandbits(48):012x}" for _ in range(40)]
    for name in names:
        feed(ingestor, run=name, world=2, first=1, steps=8, step_time=lambda r: rng.uniform(0.4, 0.6))
    feed(ingestor, run="wide", world=256, first=1, steps=8, step_time=lambda r: 0.5 + r * 1e-4)
    feed(ingestor, run="wide", world=256, first=9, steps=8, step_time=lambda r: 0.5 + r * 1e-4)
    fill_breakdown(engine, "wide", compute=lambda r: 0.3 + r * 1e-4, comm_wait=lambda r: 0.05)
    for rank in range(0, 256, 5):  # 52 flags, far more than max_flagged
        open_straggler(
            engine,
            "wide",
            rank=rank,
            host=f"node{rank // 8}",
            cost_seconds=0.01 + rank * 1e-4,
            cost_ratio=0.02,
        )

    reg = CollectorRegistry(auto_describe=True)
    reg.register(RunStateCollector(engine, cfg))
    got = series(reg)
    assert len(got) <= cfg.series_bound, (len(got), cfg.series_bound)
    runs = {labels["run"] for _, labels, _ in got if "run" in labels}
    assert len(runs) == cfg.max_runs and "wide" in runs  # the newest runs, capped
    wide = [(n, lab) for n, lab, _ in got if lab.get("run") == "wide"]
    assert len(wide) <= series_per_run(cfg.top_k, cfg.max_flagged)
    flagged = {lab["rank"] for n, lab in wide if n == "stepwatch_straggler_cost_seconds"}
    assert flagged == {"255", "250", "245", "240"}  # the costliest four
    ranked = {lab["rank"] for n, lab in wide if n == "stepwatch_rank_compute_seconds"}
    assert ranked == flagged | {"253", "254"}  # flagged + top-3 by compute (255 is both)
    # Every rank still counts in the quantiles.
    counts = [
        v for n, lab, v in got if lab.get("run") == "wide" and n == "stepwatch_run_rank_compute_seconds_count"
    ]
    assert counts == [256]
