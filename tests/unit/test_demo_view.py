"""The demo's terminal output at 80 columns: the progress line whole, the next steps exact."""

from __future__ import annotations

import io
import time

from rich.console import Console

from stepwatch.demo.runner import Plan, _next_steps, _progress
from stepwatch.views.client import Snapshot


def _lines(renderable: object, width: int = 80) -> list[str]:
    console = Console(file=io.StringIO(), width=width, record=True, color_system=None)
    console.print(renderable)
    return console.export_text().splitlines()


def _snap(step: int) -> Snapshot:
    return Snapshot(overview={"last_step": step}, ranks=[], events=[], step_times=[])


def test_the_progress_line_is_whole_at_80_columns() -> None:
    plan = Plan.default(4, 200, 2, 120.0)
    for step, phase in (
        (10, "clean"),
        (90, "rank 2 slowed +120 ms, 60-130"),
        (150, "straggler cleared at 130"),
    ):
        lines = _lines(_progress(plan, _snap(step), started=time.monotonic() - 42.0))
        assert len(lines) == 1, lines
        assert f"step {step}/200  42 s" in lines[0] and lines[0].rstrip().endswith(phase), lines
        assert any(c in lines[0] for c in "━╸")  # rich's bar, not a hand-drawn one


def test_the_compose_hint_names_the_required_secrets() -> None:
    text = _next_steps_output()
    assert "docker compose up" in text
    assert "STEPWATCH_DB_PASSWORD" in text and "GRAFANA_ADMIN_PASSWORD" in text


def _next_steps_output() -> str:
    console = Console(file=io.StringIO(), width=120, record=True, color_system=None)
    _next_steps(console, "demo-run", "/tmp/demo.db", kept=False)
    return console.export_text()
