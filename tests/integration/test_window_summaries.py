"""The census the analysis stores for /metrics (``exporter/summaries.py``), both backends:
a scrape that reads it exports what a scrape reading every rank's row exports, it is
used only while its window is unchanged and never takes the exported window back, and a
window analysed by grace keeps its census but gets no profiled summary."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import Engine, select

from stepwatch_server.exporter import ExporterConfig, RunStateCollector
from stepwatch_server.ingest.store import Ingestor
from stepwatch_server.storage.backend import open_storage
from stepwatch_server.storage.models import RankWindow, WindowSummary
from stepwatch_server.worker.loop import AnalysisWorker, WorkerConfig

from ..runstate import feed, fill_breakdown, run_id

RW = RankWindow.__table__
WS = WindowSummary.__table__


@pytest.fixture
def ingestor(engine: Engine) -> Ingestor:
    return Ingestor(open_storage(engine), window_seconds=2.0)  # 0.5 s steps -> 4 steps per window


def scrape(engine: Engine, **cfg: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of one scrape by a new collector (no memory of earlier scrapes), but
    the time it took."""
    reg = CollectorRegistry(auto_describe=True)
    reg.register(RunStateCollector(engine, ExporterConfig(**cfg)))
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in reg.collect()
        for s in fam.samples
        if s.name != "stepwatch_metrics_read_duration_seconds"
    }


def compute_ranks(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], run: str) -> set[str]:
    """The ranks of ``run`` with a compute-time series (flagged or slowest by compute)."""
    return {
        labels["rank"]
        for name, key in samples
        if name == "stepwatch_rank_compute_seconds" and (labels := dict(key))["run"] == run
    }


def analyse(engine: Engine, **cfg: Any) -> None:
    AnalysisWorker(open_storage(engine), WorkerConfig(**cfg)).run_once()


def summaries(engine: Engine, run: str) -> dict[str, tuple[int, int, int]]:
    """The run's stored rows: kind -> (window, steps, rank steps)."""
    with engine.connect() as conn:
        rows = conn.execute(select(WS).where(WS.c.run_id == run_id(engine, run))).all()
    return {r.kind: (r.window, r.steps, r.rank_steps) for r in rows}


def test_a_scrape_of_the_stored_census_exports_what_reading_every_rank_exports(
    engine: Engine, ingestor: Ingestor
) -> None:
    """40 ranks, step time and data wait varying by rank (ties among them), a profiled
    window with varied compute and collective wait: every sample, the quantiles, totals,
    breakdown and slowest ranks by compute and by step time, is the same whether the
    scrape reads the rows the analysis stored or every rank's row; and then, with the
    rows changed behind ingest's back (one rank's compute made the largest), what the
    analysis stored is what the scrape exports."""
    times = {r: 0.5 + (r * 7 % 11 - 5) / 256 for r in range(40)}  # 4-step windows (the fixture)
    for w in range(3):
        feed(
            ingestor,
            run="s",
            world=40,
            first=1 + 4 * w,
            steps=4,
            step_time=lambda r: times[r],
            wait=lambda r: (r % 5) / 100,
            profiled=True,
        )
    fill_breakdown(
        engine, "s", compute=lambda r: 0.3 + (r * 3 % 17) / 97, comm_wait=lambda r: r / 300, window=1
    )
    feed(ingestor, run="p", world=40, first=1, steps=12, step_time=lambda r: times[39 - r])  # no profiler
    # An agent that profiles but does not say through which step it sent its entries (an
    # older one): an entry may come after the analysis, so its profiled window is not kept.
    feed(ingestor, run="o", world=4, first=1, steps=12)
    fill_breakdown(engine, "o", compute=lambda r: 0.3, comm_wait=lambda r: 0.0, window=1)
    analyse(engine, summary_top=3)
    assert summaries(engine, "s") == {"census": (1, 4, 160), "profiled": (1, 4, 160)}
    assert set(summaries(engine, "p")) == {"census"}
    assert set(summaries(engine, "o")) == {"census"}
    stored = scrape(engine, top_k=3, max_flagged=0)
    with engine.begin() as conn:
        conn.execute(WS.delete())
    read = scrape(engine, top_k=3, max_flagged=0)
    assert stored.keys() == read.keys()
    assert stored == {k: pytest.approx(v, rel=1e-12, abs=1e-15) for k, v in read.items()}
    ranks = compute_ranks(stored, "s")
    assert len(ranks) == 3 and "7" not in ranks  # the top-K by compute is among what is compared
    top = ("stepwatch_run_rank_compute_seconds", (("quantile", "1.0"), ("run", "s")))
    analyse(engine, summary_top=3)  # nothing new: the rows deleted above stay deleted
    assert summaries(engine, "s") == {}
    with engine.begin() as conn:
        conn.execute(WS.delete())
    for w in range(3, 5):  # two more windows, so that the analysis summarises window 3
        feed(
            ingestor, run="s", world=40, first=1 + 4 * w, steps=4, step_time=lambda r: times[r], profiled=True
        )
    fill_breakdown(
        engine, "s", compute=lambda r: 0.3 + (r * 3 % 17) / 97, comm_wait=lambda r: r / 300, window=3
    )
    analyse(engine, summary_top=3)
    assert summaries(engine, "s") == {"census": (3, 4, 160), "profiled": (3, 4, 160)}
    with engine.begin() as conn:  # rank 7 made the slowest by compute, no step stored
        conn.execute(
            RW.update()
            .where(RW.c.run_id == run_id(engine, "s"), RW.c.rank == 7, RW.c.window == 3)
            .values(compute_s=9.0)
        )
    kept = scrape(engine, top_k=3, max_flagged=0)
    assert kept[top] == stored[top]
    assert compute_ranks(kept, "s") == ranks
    with engine.begin() as conn:
        conn.execute(WS.delete())
    assert scrape(engine, top_k=3, max_flagged=0)[top] == 9.0  # the rows themselves say otherwise


def test_the_stored_census_is_read_instead_of_the_ranks_rows_while_its_window_is_unchanged(
    engine: Engine, ingestor: Ingestor
) -> None:
    """A write behind ingest's back (one rank's row made 20x slower, which no ingest does
    without storing steps) does not show while the stored census stands; a rank's steps of
    that window arriving after the analysis (a batch overtaken by a later one) change its
    signature, and the scrape reads every rank's row again."""
    for w in range(3):  # rank 3 sends window 1's last two steps only, then window 2
        feed(ingestor, run="c", world=4, first=1 + 4 * w, steps=4, ranks=range(3))
    feed(ingestor, run="c", world=4, first=1, steps=4, ranks=[3])
    feed(ingestor, run="c", world=4, first=7, steps=6, ranks=[3], step_time=lambda r: 0.5)
    analyse(engine)
    assert summaries(engine, "c")["census"] == (1, 4, 4 + 4 + 4 + 4 - 2)
    key = ("stepwatch_run_rank_step_time_seconds_sum", (("run", "c"),))
    assert scrape(engine)[key] == pytest.approx(4 * 0.5)
    with engine.begin() as conn:
        conn.execute(
            RW.update()
            .where(RW.c.run_id == run_id(engine, "c"), RW.c.rank == 0, RW.c.window == 1)
            .values(step_time_sum=RW.c.step_time_sum * 20)
        )
    assert scrape(engine)[key] == pytest.approx(4 * 0.5)  # the stored census, not the rows
    feed(ingestor, run="c", world=4, first=5, steps=2, ranks=[3], step_time=lambda r: 2.0)
    # Rank 3's window 1 is now (2 x 2.0 + 2 x 0.5) / 4 = 1.25 s; rank 0's is 20 x 0.5.
    assert scrape(engine)[key] == pytest.approx(20 * 0.5 + 0.5 + 0.5 + 1.25)


def test_a_window_analysed_by_grace_keeps_its_census_until_the_late_rank_comes(
    engine: Engine, ingestor: Ingestor
) -> None:
    """A rank that never sent window 1 (its agent died, say): the analysis goes ahead
    without it after the grace and stores that window's census, of the 3 ranks, and no
    profiled summary (a late profiler entry would change no signature); once the rank's
    steps arrive, the signature changes and the scrape reads the rows."""
    for w in range(3):
        feed(ingestor, run="g", world=4, first=1 + 4 * w, steps=4, ranks=range(3), profiled=True)
    feed(ingestor, run="g", world=4, first=1, steps=4, ranks=[3], profiled=True)
    fill_breakdown(engine, "g", compute=lambda r: 0.3, comm_wait=lambda r: 0.0, window=1)
    analyse(engine, grace_s=0.0)
    assert summaries(engine, "g") == {"census": (1, 4, 12)}  # window 1 went by grace
    count = ("stepwatch_run_rank_step_time_seconds_count", (("run", "g"),))
    total = ("stepwatch_run_rank_step_time_seconds_sum", (("run", "g"),))
    with engine.begin() as conn:  # rank 0's rows emptied behind ingest's back: the rows tell
        conn.execute(RW.update().where(RW.c.run_id == run_id(engine, "g"), RW.c.rank == 0).values(n_steps=0))
    sample = scrape(engine)
    assert (sample[count], sample[total]) == (3, pytest.approx(3 * 0.5))  # the stored census
    feed(ingestor, run="g", world=4, first=5, steps=8, ranks=[3], step_time=lambda r: 1.5, profiled=True)
    sample = scrape(engine)  # the rows: rank 0's step time now 0, rank 3's 1.5 s
    assert (sample[count], sample[total]) == (4, pytest.approx(0.5 + 0.5 + 1.5))


def test_a_run_keeps_its_newest_row_of_each_kind(engine: Engine, ingestor: Ingestor) -> None:
    """Windows analysed over several passes replace the run's rows (one per kind), and the
    scrape uses the newest one."""
    for w in range(8):
        feed(ingestor, run="m", world=3, first=1 + 4 * w, steps=4, step_time=lambda r, w=w: 0.5 + w / 100)
        analyse(engine)
    assert summaries(engine, "m") == {"census": (6, 4, 12)}
    key = ("stepwatch_run_rank_step_time_seconds_count", (("run", "m"),))
    sample = scrape(engine)
    assert sample[key] == 3
    assert sample[("stepwatch_run_rank_step_time_seconds_sum", (("run", "m"),))] == pytest.approx(3 * 0.56)


def test_the_stored_top_k_is_read_again_when_it_holds_fewer_ranks_than_exported(
    engine: Engine, ingestor: Ingestor
) -> None:
    """An analysis that keeps fewer slowest ranks than the exporter exports (configured
    apart) leaves the top-K to the database, even for a collector that remembers an
    earlier census of the same window (it is not the census in use)."""
    feed(ingestor, run="k", world=4, first=1, steps=12, ranks=range(3))
    feed(ingestor, run="k", world=4, first=1, steps=4, ranks=[3])
    reg = CollectorRegistry(auto_describe=True)
    reg.register(RunStateCollector(engine, ExporterConfig(top_k=3, max_flagged=0)))

    def selected() -> set[str]:
        return {
            s.labels["rank"]
            for f in reg.collect()
            if f.name == "stepwatch_rank_step_time_seconds"
            for s in f.samples
        }

    assert selected() == {"0", "1", "2"}
    feed(ingestor, run="k", world=4, first=5, steps=8, ranks=[3], step_time=lambda r: 2.0)
    analyse(engine, summary_top=1)
    assert summaries(engine, "k")["census"][0] == 1
    assert selected() == {"3", "0", "1"}


def test_the_window_exported_is_the_newest_analysed_and_never_steps_back(
    engine: Engine, ingestor: Ingestor
) -> None:
    """Rank 3 one step short of window 1's end, the others in window 2: the analysis has
    summarised window 0 only. A new collector exports window 0 (the analysis not yet past
    the previous window), one that already exported window 1 keeps to it, and once the
    run is two windows past the stored census, the rows are read. Data wait tells the
    windows apart (w / 100 s per step in window w)."""
    for w in range(3):
        feed(
            ingestor, run="b", world=4, first=1 + 4 * w, steps=4, ranks=range(3), wait=lambda r, w=w: w / 100
        )
    feed(ingestor, run="b", world=4, first=1, steps=4, ranks=[3], wait=lambda r: 0.0)
    feed(ingestor, run="b", world=4, first=5, steps=3, ranks=[3], wait=lambda r: 0.01)
    key = ("stepwatch_run_rank_data_wait_seconds_sum", (("run", "b"),))
    held = CollectorRegistry(auto_describe=True)
    held.register(RunStateCollector(engine, ExporterConfig()))
    assert held.get_sample_value(key[0], dict(key[1])) == pytest.approx(4 * 0.01)  # window 1, read
    analyse(engine)
    assert summaries(engine, "b") == {"census": (0, 4, 16)}
    assert scrape(engine)[key] == pytest.approx(0.0)  # window 0, stored
    assert held.get_sample_value(key[0], dict(key[1])) == pytest.approx(4 * 0.01)  # not back to 0
    feed(ingestor, run="b", world=4, first=13, steps=4, ranks=range(3), wait=lambda r: 0.03)
    assert scrape(engine)[key] == pytest.approx(3 * 0.02)  # window 2, read: 0 is two behind
