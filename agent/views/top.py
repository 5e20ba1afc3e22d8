"""``stepwatch top``: a live terminal view of the runs and ranks of any collector.

On a terminal the view redraws in place (rich ``Live``); piped or captured, each refresh
is printed once, so ``stepwatch top --iterations 1 | less`` and tests see plain frames.
"""

from __future__ import annotations

import time

from rich.console import Console, Group, RenderableType
from rich.text import Text

from .client import CollectorClient, CollectorError
from .terminal import run_view, runs_table


def frame(client: CollectorClient, run: str | None, *, max_rows: int = 16) -> RenderableType:
    """One screen: the runs of the collector and the chosen (or most recent) run."""
    runs = client.runs()
    header = Text.assemble(("stepwatch top ", "bold"), (f"{client.url}  {time.strftime('%H:%M:%S')}", "dim"))
    if not runs:
        return Group(
            header,
            Text(
                "no runs yet: start a training with `stepwatch.init(...)` pointed at this collector "
                "(STEPWATCH_URL), or try `stepwatch demo`.",
                style="yellow",
            ),
        )
    name = run or runs[0]["name"]
    if run is not None and all(r["name"] != run for r in runs):
        known = ", ".join(r["name"] for r in runs[:10])
        raise CollectorError(f"run {run!r} is not on {client.url}; runs there: {known}")
    return Group(header, runs_table(runs, selected=name), run_view(client.snapshot(name), max_rows=max_rows))


def run_top(
    url: str,
    *,
    run: str | None = None,
    interval_s: float = 2.0,
    iterations: int | None = None,
    token: str | None = None,
    console: Console | None = None,
) -> int:
    """Refresh every ``interval_s`` until Ctrl-C (or ``iterations`` frames). Exit status
    0, or 2 with one line saying what to do when the collector cannot answer."""
    console = console or Console()
    shown = 0
    try:
        with CollectorClient(url, token=token) as client:
            if console.is_terminal and iterations != 1:
                from rich.live import Live

                with Live(console=console, auto_refresh=False, screen=False) as live:
                    while iterations is None or shown < iterations:
                        live.update(frame(client, run), refresh=True)
                        shown += 1
                        if iterations is None or shown < iterations:
                            time.sleep(interval_s)  # the refresh period of a UI, not synchronisation
            else:
                while iterations is None or shown < iterations:
                    console.print(frame(client, run))
                    shown += 1
                    if iterations is None or shown < iterations:
                        time.sleep(interval_s)
    except CollectorError as exc:
        console.print(f"[bold red]stepwatch top:[/bold red] {exc}")
        return 2
    except KeyboardInterrupt:
        return 0
    return 0
