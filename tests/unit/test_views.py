"""The terminal renderables, from API-shaped dicts: optional parts shown when present
and named when absent, outliers against the peer median stand out, big jobs stay short."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console, RenderableType
from rich.text import Text

from stepwatch.views.client import Snapshot
from stepwatch.views.terminal import (
    breakdown_bar,
    breakdown_of,
    job_breakdown,
    progress_view,
    ranks_table,
    run_view,
    sparkline,
)


def _text(renderable: RenderableType) -> str:
    console = Console(file=io.StringIO(), width=160, record=True)
    console.print(renderable)
    return console.export_text()


def _rank(rank: int, **extra: Any) -> dict[str, Any]:
    base = {
        "rank": rank,
        "host": f"node{rank // 8}",
        "last_step": 40,
        "step_time_s": 0.2,
        "data_wait_s": 0.001,
    }
    return {**base, "tokens_per_s": 5000.0, **extra}


def test_breakdown_is_read_nested_or_flat_and_absent_until_profiled() -> None:
    flat = _rank(0, compute_s=0.1, comm_exposed_s=0.05, idle_s=0.049)
    nested = _rank(1, breakdown={"compute_s": 0.3, "comm_exposed_s": 0.0, "idle_s": 0.0, "data_wait_s": 0.1})
    assert breakdown_of(_rank(2)) is None
    assert breakdown_of(flat) == {
        "compute_s": 0.1,
        "comm_overlapped_s": 0.0,
        "comm_exposed_s": 0.05,
        "data_wait_s": 0.001,  # the agent's loader wait when the profiler gives none
        "idle_s": 0.049,
    }
    assert job_breakdown([flat, nested, _rank(2)]) == {
        "compute_s": 0.2,
        "comm_overlapped_s": 0.0,
        "comm_exposed_s": 0.025,
        "data_wait_s": 0.0505,
        "idle_s": 0.0245,
    }
    assert "no profiler data yet" in _text(breakdown_bar(None))
    shares = _text(
        breakdown_bar(
            {"compute_s": 3, "comm_overlapped_s": 0, "comm_exposed_s": 1, "data_wait_s": 0, "idle_s": 0}
        )
    )
    assert "compute 75%" in shares and "comm exposed 25%" in shares


def test_a_compute_straggler_stands_out_against_the_peer_median() -> None:
    ranks = [
        _rank(r, compute_s=0.13 if r == 2 else 0.08, comm_wait_s=0.01 if r == 2 else 0.05) for r in range(4)
    ]
    table = ranks_table(ranks, [{"status": "open", "kind": "straggler", "cause": "compute", "ranks": [2]}])
    cols = {c.header: list(c.cells) for c in table.columns}
    compute, wait = cols["compute"], cols["comm wait"]
    assert [c.style for c in compute if isinstance(c, Text)] == ["", "", "bold red", ""]
    assert [c.style for c in wait if isinstance(c, Text)] == ["", "", "cyan", ""], "its peers waited for it"
    assert [str(c) for c in cols["rank"]] == ["0", "1", "⚠ 2", "3"]


def test_the_rank_table_reads_at_80_columns() -> None:
    """One header line, every header whole, tokens/s not cut, no unlabelled column."""
    ranks = [
        _rank(
            r,
            step_time_s=0.253,
            compute_s=0.131,
            comm_wait_s=0.0452,
            data_wait_s=0.00121,
            tokens_per_s=40_960.0,
        )
        for r in range(4)
    ]
    for events in ([], [{"status": "open", "kind": "straggler", "cause": "compute", "ranks": [2]}]):
        table = ranks_table(ranks, events)
        assert all(str(c.header).strip() for c in table.columns), "every column has a header"
        console = Console(width=80, record=True, color_system=None)
        console.print(table)
        lines = console.export_text().splitlines()
        assert max(len(line) for line in lines) <= 80
        header = next(line for line in lines if "rank" in line and "host" in line)
        for label in ("rank", "host", "last step", "step", "compute", "comm wait", "data wait", "tokens/s"):
            assert label in header, (label, lines)
        assert sum("40,960" in line for line in lines) == 4, lines


def test_a_large_job_shows_the_flagged_and_slowest_ranks_only() -> None:
    ranks = [_rank(r, step_time_s=0.2 + (0.001 * r if r < 10 else 0.0)) for r in range(1000)]
    table = ranks_table(ranks, [{"status": "open", "kind": "hang", "ranks": [777]}], max_rows=8)
    shown = [int(str(c).removeprefix("⚠ ")) for c in next(iter(table.columns)).cells]
    assert shown == [3, 4, 5, 6, 7, 8, 9, 777]
    assert "992 more not shown" in str(table.title)


def test_progress_and_trend() -> None:
    assert progress_view({"progress": None}) is None
    view = progress_view({"progress": {"fraction_done": 0.25, "eta_s": 7 * 86400, "on_track": False}})
    assert view is not None
    out = _text(view)
    assert "25.0%" in out and "ETA 7.0 days" in out and "behind plan" in out
    assert sparkline([1.0, 2.0, None, 8.0]) == "▁▂ █"
    assert sparkline([3.0, 3.0]) == "▁▁"


def test_run_view_renders_an_empty_run_without_failing() -> None:
    stat = {"latest": None, "mean": None}
    overview = {"name": "fresh", "world_size": 8, "ranks_reporting": 0, "last_step": None, "convention": None}
    overview |= {k: stat for k in ("mfu", "tokens_per_s", "step_time_s", "data_wait_s")}
    out = _text(run_view(Snapshot(overview=overview, ranks=[], events=[])))
    assert "fresh" in out and "0/8 ranks" in out and "none (no peak FLOP/s)" in out
    assert "events: none" in out
