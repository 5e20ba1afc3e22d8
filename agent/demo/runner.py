"""``stepwatch demo``: a collector on SQLite, a real multi-rank CPU training timed always-on,
a straggler injected mid-run and cleared later, and a live terminal view read from the
collector's API (what a user of ``stepwatch top`` would see), then a short report.

Every process the demo starts is stopped when it ends, fails, or is interrupted (Ctrl-C
or SIGTERM): the collector and the ranks live inside context managers that stop them.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from ..views.client import CollectorClient, CollectorError, Snapshot
from ..views.terminal import num, pct, run_view
from . import launch

#: The collector closes a stored rank window about every this many seconds, so that the
#: straggler detection (3 windows to open a flag, 3 clean ones to close it) fits the demo.
WINDOW_SECONDS = 1.0
#: ... and analyses them every second (default 5 s), so the flag opens and closes sooner
#: and the report waits little for the last pass.
ANALYSIS_INTERVAL_S = 1.0
#: The demo profiles 2 steps in every 8 (about one window per stored 1 s window).
PROFILE_EVERY = 8
PROFILE_BUDGET = 0.5
WARMUP_STEPS = 5


def measure_cpu_peak_flops(n: int = 256, repeats: int = 30) -> float:
    """Best observed single-thread fp32 matmul rate on this CPU.

    CPUs have no datasheet row in stepwatch's peak table, so the demo *declares* a peak
    it measured (and says so in the convention); it is an upper bound in practice, not
    the vendor's theoretical number.
    """
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(n, n), torch.randn(n, n)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


@dataclass(frozen=True)
class Plan:
    ranks: int
    steps: int
    slow_rank: int
    slow_ms: float
    slow_from: int
    slow_to: int

    @classmethod
    def default(cls, ranks: int, steps: int, slow_rank: int | None, slow_ms: float) -> Plan:
        """The straggler covers the middle third of the run: enough clean steps before
        it for a baseline and after it for the flag to clear."""
        rank = -1 if slow_rank is None or slow_ms <= 0 else slow_rank
        if rank >= ranks:
            raise ValueError(f"--slow-rank {rank} is not one of the {ranks} ranks (0-{ranks - 1})")
        return cls(ranks, steps, rank, slow_ms, max(1, round(steps * 0.3)), max(1, round(steps * 0.65)))

    @property
    def has_straggler(self) -> bool:
        return self.slow_rank >= 0

    def train_args(self, run: str, peak: float) -> list[str]:
        args = ["--run", run, "--steps", str(self.steps), "--peak-flops", str(peak)]
        args += ["--send-interval", "1", "--warmup-steps", str(WARMUP_STEPS)]
        # A short run needs frequent profiler windows to show its breakdown and to name a
        # compute straggler (production default: every 2,000 steps within a 1% budget).
        args += ["--profile-every", str(PROFILE_EVERY), "--profile-steps", "2"]
        args += ["--profile-budget", str(PROFILE_BUDGET)]
        if self.has_straggler:
            args += ["--slow-rank", str(self.slow_rank), "--slow-ms", str(self.slow_ms)]
            args += ["--slow-from", str(self.slow_from), "--slow-to", str(self.slow_to)]
        return args

    def phase(self, step: int) -> str:
        """What the demo itself does to the training at ``step``: the fault it injects,
        not what the collector concluded (its flag, open or closed, is in the events)."""
        if not self.has_straggler or step < self.slow_from:
            return "no fault injected"
        if step <= self.slow_to:
            return f"rank {self.slow_rank}: +{self.slow_ms:.0f} ms injected, {self.slow_from}-{self.slow_to}"
        return f"rank {self.slow_rank}: injection ended at {self.slow_to}"


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so the context managers stop every child."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _progress(plan: Plan, snap: Snapshot | None, started: float) -> Table:
    """One line: rich's progress bar, the step, the time and the phase of the fault,
    short enough for 80 columns (the phase folds onto a second line rather than vanish)."""
    step = int(snap.overview.get("last_step") or 0) if snap else 0
    line = Table.grid(padding=(0, 1))
    line.add_column(no_wrap=True)
    line.add_column(width=16, no_wrap=True)
    line.add_column(no_wrap=True)
    line.add_column(overflow="fold")
    phase = plan.phase(step)
    line.add_row(
        Text("training", style="bold"),
        ProgressBar(total=plan.steps, completed=min(step, plan.steps), width=16),
        f"step {step}/{plan.steps}  {time.monotonic() - started:.0f} s",
        Text(phase, style="yellow" if " injected" in phase else "dim"),
    )
    return line


def live_frame(plan: Plan, snap: Snapshot | None, started: float, page: str) -> RenderableType:
    """The live view: compact, so that 4 ranks and a few events fit an 80x24 terminal
    (the report at the end has every event's whole message)."""
    head = Group(_progress(plan, snap, started), Text(f"page {page} · Ctrl-C stops all", style="dim"))
    if snap is None:
        return Group(head, Text("waiting for the first window from the ranks ...", style="dim"))
    return Group(head, run_view(snap, compact=True))


def straggler_cost(steps: list[dict[str, Any]], plan: Plan) -> tuple[float, float] | None:
    """Mean job step time inside the slow window and in the clean steps after warm-up,
    from the per-step series (what every rank paid for one slow rank)."""
    inside = [p["mean"] for p in steps if plan.slow_from < p["step_from"] <= plan.slow_to and p["mean"]]
    clean = [
        p["mean"]
        for p in steps
        if p["step_from"] > WARMUP_STEPS + 2
        and not plan.slow_from <= p["step_from"] <= plan.slow_to + 2
        and p["mean"]
    ]
    if len(inside) < 3 or len(clean) < 3:
        return None
    return statistics.median(inside), statistics.median(clean)


def settle(client: CollectorClient, run: str, timeout_s: float) -> None:
    """Wait (at most ``timeout_s``) until the collector has analysed the run's last
    windows, i.e. no straggler flag is open any more, so that the report does not show a
    flag as open that the next analysis pass would close. A flag still open after that
    stays in the report as the collector has it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        events = client.events(run)
        if not any(e.get("kind") == "straggler" and e.get("status") == "open" for e in events):
            return
        time.sleep(0.5)  # the collector's analysis pass runs every ANALYSIS_INTERVAL_S


def report(console: Console, client: CollectorClient, run: str, plan: Plan) -> Snapshot:
    """The closing summary: the run (its events with their whole messages, once), then
    what the straggler cost."""
    snap = client.snapshot(run, last_steps=plan.steps, points=36)
    console.print(run_view(snap))
    ov = snap.overview
    tps, mfu = num(ov["tokens_per_s"]["mean"], ",.0f"), pct(ov["mfu"]["mean"])
    formula = (ov.get("convention") or {}).get("id", "none")
    console.print(
        f"[bold]{run}[/bold]: {ov['steps_stored']} steps on {ov['world_size']} ranks, "
        f"{ov['tokens_total']:,} tokens; mean {tps} tokens/s, MFU {mfu} (formula {formula})"
    )
    if plan.has_straggler:
        series = client.series(run, "step_time_s", max_points=10_000)["points"]
        cost = straggler_cost(series, plan)
        if cost is not None:
            slow, clean = cost
            what = (
                f"straggler: rank {plan.slow_rank} ran {plan.slow_ms:.0f} ms/step slower in steps "
                f"{plan.slow_from}-{plan.slow_to}; "
            )
            if slow > clean * 1.03:
                console.print(
                    f"{what}the job's step time went from {clean:.3f} s to {slow:.3f} s "
                    f"({(slow - clean) / clean:+.0%}) on every rank: the others wait for it in the "
                    "all-reduce."
                )
            else:  # say what was measured, not what should have happened
                console.print(
                    f"{what}the job's step time was {slow:.3f} s during it and {clean:.3f} s outside: "
                    "other load on this machine hid the difference this time."
                )
        named = [e for e in snap.events if e.get("kind") == "straggler"]
        if not named:  # the events above already list the ones it flagged
            console.print(
                "[yellow]no straggler event from this collector[/yellow]: naming the rank takes the "
                "collector's straggler detection (and, for the compute/wait split per rank, the "
                "agent's profiler window)"
            )
    return snap


def run_demo(
    ranks: int = 4,
    steps: int = 120,
    *,
    slow_rank: int | None = 2,
    slow_ms: float = 120.0,
    keep: bool = False,
    database: str | None = None,
    hold: bool = False,
    refresh_s: float = 1.0,
    console: Console | None = None,
) -> int:
    console = console or Console()
    t0 = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="stepwatch-demo-")
    kept = keep or database is not None
    if database is None:
        database = os.path.abspath("stepwatch-demo.db") if keep else os.path.join(workdir, "demo.db")
    run = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        plan = Plan.default(ranks, steps, slow_rank, slow_ms)
        with _sigterm_as_interrupt(), ExitStack() as stack:
            with console.status("measuring this CPU's matmul peak (the MFU denominator) ..."):
                peak = measure_cpu_peak_flops()
            console.print(
                f"[dim]measured CPU peak (1 thread, fp32 matmul): {peak / 1e9:.1f} GFLOP/s per rank[/dim]"
            )
            with console.status("starting the collector (SQLite, migrations) ..."):
                col = stack.enter_context(
                    launch.collector(
                        f"sqlite:///{database}",
                        log_path=os.path.join(workdir, "collector.log"),
                        env={
                            "STEPWATCH_WINDOW_SECONDS": str(WINDOW_SECONDS),
                            "STEPWATCH_ANALYSIS_INTERVAL_S": str(ANALYSIS_INTERVAL_S),
                        },
                    )
                )
            client = stack.enter_context(CollectorClient(col.url))
            page = f"{col.url}/runs/{run}"
            console.print(f"collector [bold]{col.url}[/bold] (SQLite {database})")
            console.print(f"web page  [bold]{page}[/bold]")
            straggler = (
                f"; rank {plan.slow_rank} will be slowed by {plan.slow_ms:.0f} ms/step in steps "
                f"{plan.slow_from}-{plan.slow_to}"
                if plan.has_straggler
                else ""
            )
            console.print(f"training {ranks} gloo ranks x {steps} steps of a tiny GPT{straggler}")
            args = plan.train_args(run, peak)
            with launch.ranks(ranks, args, env={"STEPWATCH_URL": col.url}, log_dir=workdir) as procs:
                _watch(console, client, plan, run, procs, workdir, page, refresh_s)
            with console.status("waiting for the collector's last analysis of the run ..."):
                settle(client, run, timeout_s=5 * ANALYSIS_INTERVAL_S + 5)
            report(console, client, run, plan)
            console.print(f"[green]demo finished in {time.monotonic() - t0:.1f} s[/green]")
            _next_steps(console, run, database, kept=kept)
            if hold:
                console.print(f"collector still serving [bold]{page}[/bold]; Ctrl-C stops it")
                while col.process.poll() is None:
                    time.sleep(0.5)  # idle until Ctrl-C; nothing to synchronise with
        return 0
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; the collector and every rank were stopped[/yellow]")
        return 130
    except (RuntimeError, TimeoutError, ValueError, CollectorError) as exc:
        console.print(f"[bold red]demo failed:[/bold red] {exc}")
        console.print("[dim]run again with --keep to inspect the data afterwards[/dim]")
        return 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _watch(
    console: Console,
    client: CollectorClient,
    plan: Plan,
    run: str,
    procs: list[Any],
    workdir: str,
    page: str,
    refresh_s: float,
) -> None:
    """Redraw the live view from the API until every rank has exited."""
    started = time.monotonic()
    deadline = started + 600
    snap: Snapshot | None = None

    def fetch() -> Snapshot | None:
        try:
            return client.snapshot(run)
        except CollectorError:  # 404 until the first window arrives
            return snap

    if console.is_terminal:
        from rich.live import Live

        with Live(live_frame(plan, None, started, page), console=console, auto_refresh=False) as live:
            while not launch.poll_all(procs, workdir):
                if time.monotonic() > deadline:
                    raise TimeoutError("the demo's ranks did not finish within 600 s")
                snap = fetch()
                live.update(live_frame(plan, snap, started, page), refresh=True)
                time.sleep(refresh_s)  # the view's refresh period
            live.update(Text(""), refresh=True)
        return
    last_print = 0.0
    while not launch.poll_all(procs, workdir):  # piped output: one progress line every few seconds
        if time.monotonic() > deadline:
            raise TimeoutError("the demo's ranks did not finish within 600 s")
        if time.monotonic() - last_print >= 5:
            snap = fetch()
            console.print(_progress(plan, snap, started))
            last_print = time.monotonic()
        time.sleep(0.2)


def _next_steps(console: Console, run: str, database: str, *, kept: bool) -> None:
    """Where to go from here, each line within 80 columns (a wrapped command is easy to
    copy wrong)."""
    console.print("[bold]where to look next[/bold]")
    if kept:
        console.print(f"  web page  stepwatch serve --database-url sqlite:///{database}")
        console.print(f"            then open http://127.0.0.1:8321/runs/{run}")
    else:
        console.print("  web page  stepwatch demo --hold  (collector and page stay up until Ctrl-C)")
    console.print("  terminal  stepwatch top --url URL  (any collector)")
    console.print(
        "  Grafana   STEPWATCH_DB_PASSWORD=... GRAFANA_ADMIN_PASSWORD=... \\\n"
        "              docker compose up\n"
        "            (collector, PostgreSQL, Prometheus, Alertmanager and dashboards/;\n"
        "            both secrets are required, from the environment or an .env file)"
    )
