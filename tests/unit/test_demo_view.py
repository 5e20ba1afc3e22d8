"""The demo's terminal output at 80 columns: the progress line whole, the live frame within
24 lines, events readable, the next steps unwrapped."""

from __future__ import annotations

import io
import time

from rich.console import Console

from stepwatch.demo.runner import Plan, _next_steps, _progress, live_frame
from stepwatch.views.client import Snapshot
from stepwatch.views.terminal import events_view, progress_view, run_view


def _lines(renderable: object, width: int = 80) -> list[str]:
    console = Console(file=io.StringIO(), width=width, record=True, color_system=None)
    console.print(renderable)
    return console.export_text().splitlines()


def _snap(step: int) -> Snapshot:
    return Snapshot(overview={"last_step": step}, ranks=[], events=[], step_times=[])


def test_the_progress_line_is_whole_at_80_columns() -> None:
    plan = Plan.default(4, 200, 2, 120.0)
    for step, phase in (
        (10, "no fault injected"),
        (90, "rank 2: +120 ms injected, 60-130"),
        # What the demo did, not the collector's verdict (its flag may still be open).
        (150, "rank 2: injection ended at 130"),
    ):
        lines = _lines(_progress(plan, _snap(step), started=time.monotonic() - 42.0))
        assert len(lines) == 1, lines
        assert f"step {step}/200  42 s" in lines[0] and lines[0].rstrip().endswith(phase), lines
        assert any(c in lines[0] for c in "━╸")  # rich's bar, not a hand-drawn one


def test_the_compose_hint_names_the_required_secrets() -> None:
    text = _next_steps_output()
    assert "docker compose up" in text
    assert "STEPWATCH_DB_PASSWORD" in text and "GRAFANA_ADMIN_PASSWORD" in text


def _next_steps_output(width: int = 120, kept: bool = False) -> str:
    console = Console(file=io.StringIO(), width=width, record=True, color_system=None)
    _next_steps(console, "demo-20261203-063946", "/tmp/demo.db", kept=kept)
    return console.export_text()


def test_the_next_steps_are_not_wrapped_at_80_columns() -> None:
    # Wrapped, "docker compose" and "up" landed on two lines and the notes overflowed.
    for kept in (False, True):
        assert _next_steps_output(80, kept) == _next_steps_output(200, kept)
    assert "docker compose up" in _next_steps_output(80)


MESSAGE = (
    "Rank 2 (host vm) was a compute straggler from step 39 to 78: its peers waited for it at "
    "the gradient all-reduce on 7 of 8 steps, 0.05 s per step (13.1% of the step, sign test "
    "p=0.035); 0.04 s more training-thread CPU per step than its peers' 0.05 s; cost 0.09 s/step "
    "(24.0%)."
)
EVENT = {
    "status": "open",
    "kind": "straggler",
    "cause": "compute",
    "ranks": [2],
    "first_step": 39,
    "last_step": 78,
    "cost_seconds": 0.0897,
    "cost_ratio": 0.2404,
    "message": MESSAGE,
}


def test_an_event_message_uses_the_whole_width() -> None:
    lines = _lines(events_view([EVENT]))
    text = " ".join(line.strip() for line in lines)
    assert " ".join(MESSAGE.split()) in " ".join(text.split())
    # The message wraps at the terminal's width, not in a 17-column cell (24 lines).
    assert len(lines) <= 1 + 1 + -(-len(MESSAGE) // 70), lines  # legend, numbers, message
    assert "open" in lines[1] and "straggler/compute" in lines[1] and "steps 39–78" in lines[1]
    assert "open: flagged now" in lines[0]  # what open and closed mean


def _overview() -> dict[str, object]:
    stat = {"latest": 0.05, "mean": 0.048}
    ov: dict[str, object] = {k: stat for k in ("mfu", "tokens_per_s", "step_time_s", "data_wait_s")}
    return ov | {
        "name": "demo-20261203-063946",
        "status": "live",
        "world_size": 4,
        "ranks_reporting": 4,
        "last_step": 71,
        "convention": {"id": "6N+12LHQT(causal)/fp32/cpu@0.102TFLOPs[user]", "dtype_source": "given"},
        "progress": {"tokens_done": 368_217.0, "fraction_done": None, "eta_s": None},
    }


def _rank(r: int) -> dict[str, object]:
    return {
        "rank": r,
        "host": "vm",
        "last_step": 71,
        "step_time_s": 0.37,
        "data_wait_s": 0.0005,
        "comm_wait_s": 0.1,
        "tokens_per_s": 2230.0,
        "profile": {"compute_s": 0.23, "comm_overlapped_s": 0.02, "comm_exposed_s": 0.1, "idle_s": 0.01},
    }


def test_the_live_frame_fits_an_80x24_terminal() -> None:
    # Rich's Live crops a frame taller than the terminal: the events, at the bottom, were
    # cut to "..." for the whole run.
    steps = [
        {"step_from": i, "step_to": i, "mean": 0.3 + 0.01 * (i % 5)} for i in range(1, 49)
    ]  # the live view asks for 48 points
    events = [EVENT, EVENT | {"status": "closed", "ranks": [1]}, EVENT, EVENT]
    snap = Snapshot(overview=_overview(), ranks=[_rank(r) for r in range(4)], events=events, step_times=steps)
    lines = _lines(
        live_frame(
            Plan.default(4, 120, 2, 120.0),
            snap,
            time.monotonic() - 60,
            "http://127.0.0.1:39123/runs/demo-20261203-063946",
        )
    )
    assert len(lines) <= 23, "\n".join(lines)  # and a line for the cursor
    assert any("straggler/compute" in line for line in lines)
    assert any("2 more" in line for line in lines)  # what did not fit is counted, not cut
    # The report (run_view, not compact) has every message whole, the trend on one line.
    report = _lines(run_view(snap))
    assert " ".join(MESSAGE.split()) in " ".join(" ".join(report).split())
    (trend,) = [line for line in report if line.startswith("step time ") and "(s)" not in line]
    assert trend.rstrip().endswith(" s"), report


def test_a_run_without_a_token_target_gets_a_whole_progress_line() -> None:
    # It printed "progress " with nothing after it.
    view = progress_view(
        {"progress": {"tokens_done": 368_217.0, "fraction_done": None, "target_tokens": None}}
    )
    assert view is not None
    (line,) = _lines(view, width=100)
    assert "368,217 tokens done" in line and "target_tokens=" in line
    assert progress_view({"progress": {"tokens_done": None}}) is None
