"""The ``stepwatch simulate`` command: options, a progress bar, and what the collector found."""

from __future__ import annotations

import argparse
import math
import os
import time
from typing import Any

import httpx

from .._payload import plan_section
from ..config import DEFAULT_URL
from .driver import Simulation, WindowMismatchError
from .faults import parse_fault
from .model import Noise, TimingModel
from .topology import Topology

EPILOG = """\
faults (repeat --fault):
  compute:rank=R,at=W[,mag=0.2]     rank R computes 20% longer from window W
  link:rank=R,at=W[,mag=0.5]        every group of rank R transfers 50% slower
  data:rank=R,at=W[,mag=0.15]       rank R's loader waits 0.15 s more per step
  host:host=H,at=W[,mag=0.2]        every rank of host H computes 20% longer
  mfu:at=W[,mag=0.05,component=comm_exposed_s]   the job's MFU falls by 5%
  hang:rank=R,at=W                  the job stops at window W (real clock)
  silent:rank=R,at=W                rank R's agent goes silent (real clock)
  add until=W2 to end a fault before the run does.

example: stepwatch simulate --hosts 64 --ranks-per-host 8 --tp 8 --pp 4 --windows 200 \\
             --fault compute:rank=13,at=50 --fault mfu:at=120,mag=0.05
"""


def default_steps_per_window(window_seconds: float, step_time_s: float) -> int:
    """The collector's choice (a power of two near ``window_seconds`` of steps)."""
    target = max(1.0, window_seconds / step_time_s)
    return int(min(4096, 2 ** round(math.log2(target))))


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "simulate",
        help="send simulated ranks (with injectable faults) to a collector through the real agent path",
        description="Simulate a synchronous training job of many ranks and send what their agents "
        "would send (per-step windows, time breakdown) to a collector over HTTP, through the agent's "
        "own payload builder and sender.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--url", default=None, help=f"collector URL (default STEPWATCH_URL or {DEFAULT_URL})")
    p.add_argument("--token", default=None, help="bearer token (default STEPWATCH_TOKEN)")
    p.add_argument("--run", default=None, help="run name (default sim-<time>)")
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--ranks-per-host", type=int, default=8)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size")
    p.add_argument("--windows", type=int, default=60, help="windows to send per rank")
    p.add_argument("--step-time", type=float, default=2.0, help="nominal step time, seconds")
    p.add_argument(
        "--window-seconds", type=float, default=10.0, help="the collector's STEPWATCH_WINDOW_SECONDS"
    )
    p.add_argument("--steps-per-window", type=int, default=None, help="default: as the collector will choose")
    p.add_argument("--mfu", type=float, default=0.40, help="clean MFU the token count is chosen for")
    p.add_argument("--fault", action="append", default=[], metavar="SPEC", help="inject a fault (see below)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--senders", type=int, default=8, help="sender threads shared by all ranks")
    p.add_argument("--clock", choices=["sim", "real"], default="sim", help="wall clock of the windows")
    p.add_argument("--checkpoint-every", type=int, default=1000, help="steps between checkpoints (0: none)")
    p.add_argument("--eval-every", type=int, default=0, help="steps between evaluation passes (0: none)")
    p.add_argument("--target-tokens", type=float, default=None, help="plan: tokens the run must process")
    p.add_argument("--deadline-days", type=float, default=None, help="plan: deadline, days from now")
    p.add_argument("--fingerprint", default=None, help="plan: config fingerprint")
    p.add_argument("--baseline-run", default=None, help="plan: baseline run to compare with")
    p.add_argument("--wait", type=float, default=30.0, help="seconds to wait for the analysis afterwards")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    url = args.url or os.environ.get("STEPWATCH_URL") or DEFAULT_URL
    token = args.token or os.environ.get("STEPWATCH_TOKEN") or None
    run = args.run or f"sim-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        topo = Topology(args.hosts, args.ranks_per_host, tp=args.tp, pp=args.pp, cp=args.cp)
        faults = [parse_fault(f) for f in args.fault]
    except ValueError as exc:
        console.print(f"[red]{exc}[/red]")
        return 2
    spw = args.steps_per_window or default_steps_per_window(args.window_seconds, args.step_time)
    noise = Noise(checkpoint_every=args.checkpoint_every, eval_every=args.eval_every)
    model = TimingModel(
        topo,
        step_time_s=args.step_time,
        steps_per_window=spw,
        mfu=args.mfu,
        faults=faults,
        noise=noise,
        seed=args.seed,
    )
    deadline = time.time() + args.deadline_days * 86_400 if args.deadline_days else None
    plan = plan_section(
        target_tokens=int(args.target_tokens) if args.target_tokens else None,
        deadline=deadline,
        config_fingerprint=args.fingerprint,
        baseline_run=args.baseline_run,
    )
    console.print(
        f"run [bold]{run}[/bold]: {topo.world} ranks on {topo.hosts} hosts (dp {topo.dp}, tp {topo.tp}, "
        f"pp {topo.pp}, cp {topo.cp}), {args.windows} windows of {spw} steps -> {url}"
    )
    for f in faults:
        console.print(f"  fault {f.spec}")
    progress = None
    if not args.no_progress:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        progress = Progress(
            TextColumn("windows"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), console=console
        )
    task = progress.add_task("send", total=args.windows) if progress else None
    sim = Simulation(
        model,
        url=url,
        run=run,
        token=token,
        senders=args.senders,
        clock=args.clock,
        plan=plan,
        on_window=(lambda _: progress.advance(task)) if progress is not None and task is not None else None,
    )
    try:
        if progress is not None:
            progress.start()
        result = sim.run_windows(args.windows)
    except WindowMismatchError as exc:
        console.print(f"[red]{exc}[/red]")
        return 2
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/yellow]")
        return 130
    finally:
        if progress is not None:
            progress.stop()
    rate = result.sent_batches / result.elapsed_s if result.elapsed_s > 0 else 0.0
    console.print(
        f"sent {result.sent_batches:,} of {result.batches:,} batches ({result.windows} windows, last step "
        f"{result.last_step:,}) in {result.elapsed_s:.1f} s, {rate:,.0f} batches/s; "
        f"{result.failed_attempts} retried attempts, {result.rejected_batches} rejected"
    )
    if args.wait > 0:
        _show_findings(console, url, token, run, result.last_step if not result.hung else 0, args.wait)
    return 0 if result.rejected_batches == 0 else 1


def _show_findings(
    console: Any, url: str, token: str | None, run: str, last_step: int, wait_s: float
) -> None:
    """Wait (bounded) for the collector's analysis to reach the last step; print its events."""
    headers = {"authorization": f"Bearer {token}"} if token else {}
    deadline = time.monotonic() + wait_s
    with httpx.Client(base_url=url, headers=headers, timeout=10.0) as c:
        while time.monotonic() < deadline:
            ov = c.get(f"/api/v1/runs/{run}").json()
            done = (ov.get("analysis") or {}).get("analysed_through_step", 0)
            if last_step and done >= last_step:
                break
            time.sleep(0.5)
        events = c.get(f"/api/v1/runs/{run}/events").json()
    if not events:
        console.print(f"events of {run}: none")
        return
    console.print(f"events of {run} (newest first):")
    for e in events:
        colour = "red" if e["status"] == "open" else "dim"
        console.print(
            f"  [{colour}]{e['status']:6s}[/{colour}] {e['kind']:10s} {e['message']}", soft_wrap=True
        )
