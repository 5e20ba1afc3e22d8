"""Two ways to run a scenario, both ending in the flags the analysis raised.

``collector``: the simulator sends every rank's windows through the agent's payload
builder and :class:`~stepwatch._sender.Sender` over HTTP to a real ``stepwatch serve``
process (its own database); its analysis worker raises events, which are read back from
``GET /api/v1/runs/{run}/events``. This is the whole product path.

``direct``: the same seeded timing model, converted to the analysis' input types as
storage would (per-rank window means, per-step job rows) and fed straight into
:class:`~..analysis.pipeline.RunAnalysis`: no HTTP, no database, so long clean runs and
many seeds fit in seconds. The collector path checks that the two agree.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from stepwatch.demo import launch
from stepwatch.simulate import Simulation, TimingModel, WindowTimings

from ..analysis.pipeline import RunAnalysis, StepRow
from ..analysis.types import RankWindow, StepTag
from ..worker.inputs import comm_groups
from .scenarios import Scenario

#: Collector settings for the evaluation: windows of the scenarios' 16 steps of 2 s, a
#: fast analysis interval, a short grace, and a hang floor that fits a test's patience.
COLLECTOR_ENV = {
    "STEPWATCH_WINDOW_SECONDS": "32",
    "STEPWATCH_ANALYSIS_INTERVAL_S": "0.2",
    "STEPWATCH_ANALYSIS_GRACE_S": "5",
    "STEPWATCH_HANG_FLOOR_S": "3",
    "STEPWATCH_HANG_STARTUP_S": "30",
    "STEPWATCH_HANG_K": "10",
}


@dataclass(frozen=True)
class Flag:
    """A flag as the scoring sees it, from either path."""

    key: str
    kind: str
    cause: str | None
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]
    status: str
    opened_window: int | None
    evidence: dict[str, float]
    opened_at: float | None = None
    message: str = ""


@dataclass(frozen=True)
class Outcome:
    """What one run of one scenario produced."""

    scenario: Scenario
    path: str
    seed: int
    flags: tuple[Flag, ...]
    rank_windows: int
    job_windows: int
    seconds: float
    fault_time: float | None = None
    hang_threshold_s: float | None = None


def model_for(s: Scenario, seed: int) -> TimingModel:
    return TimingModel(
        s.topology,
        step_time_s=s.step_time_s,
        steps_per_window=s.steps_per_window,
        faults=s.faults,
        noise=s.noise,
        seed=seed,
    )


# -- direct ------------------------------------------------------------------------------
def to_rank_windows(run: str, model: TimingModel, wt: WindowTimings) -> list[RankWindow]:
    """A window of the model as storage would hand it to the detectors."""
    topo = model.topology
    layout = topo.layout.to_dict()
    mp = topo.model_parallel
    n = wt.n_steps
    step_mean = sum(wt.step_time_s) / n
    out = []
    for r, t in enumerate(wt.ranks):
        if r in wt.silent:
            continue
        c = topo.coords[r]
        groups = comm_groups(c, layout)
        out.append(
            RankWindow(
                run=run,
                rank=r,
                host=topo.host(r),
                local_rank=r % topo.ranks_per_host,
                window=wt.index,
                first_step=wt.first_step,
                last_step=wt.last_step,
                n_steps=n,
                step_time_s=step_mean,
                data_wait_s=t.data_wait_s,
                compute_s=t.compute_s,
                comm_exposed_s=t.comm_exposed_s,
                comm_overlapped_s=t.comm_overlapped_s,
                idle_s=t.idle_s,
                comm_wait_s=t.comm_wait_s,
                comm_transfer_s=t.comm_transfer_s,
                dp_rank=c["dp"] if mp else None,
                tp_rank=c["tp"] if mp else None,
                pp_rank=c["pp"] if mp else None,
                cp_rank=c["cp"] if mp else None,
                groups=groups,
                group_transfer_s={k: v for k, v in t.group_transfer_s.items() if k in groups},
            )
        )
    return out


def to_step_rows(model: TimingModel, wt: WindowTimings, wall_start: float) -> list[StepRow]:
    rows = []
    wall = wall_start
    for j, (dt, tag) in enumerate(zip(wt.step_time_s, wt.tags, strict=True)):
        wall += dt
        rows.append(StepRow(wt.first_step + j, dt, float(model.tokens_per_step), _tag(tag), wall))
    return rows


def _tag(tag: str | None) -> StepTag | None:
    return tag  # type: ignore[return-value]


def run_direct(s: Scenario, seed: int) -> Outcome:
    t0 = time.perf_counter()
    model = model_for(s, seed)
    run = f"direct-{seed}"
    analysis = RunAnalysis(run)
    rate = model.flops_per_token / (model.topology.world * model.peak_flops)
    flags: dict[tuple[str, int], Flag] = {}
    rank_windows = job_windows = 0
    wall = 0.0
    for wt in model.windows(s.windows):
        ranks = to_rank_windows(run, model, wt)
        steps = to_step_rows(model, wt, wall)
        wall = steps[-1].wall_end
        rank_windows += len(ranks)
        job_windows += 1
        for ch in analysis.feed(
            wt.index,
            ranks,
            steps,
            first_step=wt.first_step,
            last_step=wt.last_step,
            mfu_per_token_rate=rate,
        ):
            f = ch.finding
            ident = (f.key, f.first_step)
            opened = flags[ident].opened_window if ident in flags else ch.window
            flags[ident] = Flag(
                f.key,
                f.kind,
                f.cause,
                f.ranks,
                f.hosts,
                f.status,
                opened,
                dict(f.evidence),
                message=f.message,
            )
    for f in analysis.open_findings():  # latest evidence of what is still open
        ident = (f.key, f.first_step)
        if ident in flags:
            old = flags[ident]
            flags[ident] = Flag(
                f.key,
                f.kind,
                f.cause,
                f.ranks,
                f.hosts,
                f.status,
                old.opened_window,
                dict(f.evidence),
                message=f.message,
            )
    return Outcome(
        s, "direct", seed, tuple(flags.values()), rank_windows, job_windows, time.perf_counter() - t0
    )


# -- collector ---------------------------------------------------------------------------
@contextmanager
def collector(database_url: str | None = None) -> Iterator[str]:
    """A real ``stepwatch serve`` process with the evaluation's settings; yields its URL."""
    with tempfile.TemporaryDirectory(prefix="stepwatch-eval-") as tmp:
        url = database_url or f"sqlite:///{os.path.join(tmp, 'eval.db')}"
        with launch.collector(url, log_path=os.path.join(tmp, "collector.log"), env=COLLECTOR_ENV) as col:
            yield col.url


def _flags_from_events(events: list[dict[str, Any]]) -> tuple[Flag, ...]:
    out = []
    for e in events:
        ev = e["evidence"]
        opened = ev.get("opened_window")
        out.append(
            Flag(
                key=e["key"],
                kind=e["kind"],
                cause=e["cause"],
                ranks=tuple(e["ranks"]),
                hosts=tuple(e["hosts"]),
                status=e["status"],
                opened_window=None if opened is None else int(opened),
                evidence={k: float(v) for k, v in ev.items()},
                opened_at=float(e["opened_at"]),
                message=e["message"],
            )
        )
    return tuple(out)


def run_collector(s: Scenario, seed: int, base_url: str, *, timeout_s: float = 60.0) -> Outcome:
    """Send the scenario to the collector at ``base_url``; wait for its analysis; read events."""
    t0 = time.perf_counter()
    model = model_for(s, seed)
    named = s.name.replace("%", "pct").replace("+", "plus-")
    slug = "".join(c if c.isalnum() or c in "-_." else "-" for c in named).strip("-")
    run = f"eval-{slug}-{s.topology.world}-{s.topology.tp}x{s.topology.pp}-{seed}"
    sent_at: dict[int, float] = {}
    sim = Simulation(
        model,
        url=base_url,
        run=run,
        senders=4,
        check_windows=not s.realtime,
        on_window=lambda wt: sent_at.__setitem__(wt.index, time.time()),
    )
    result = sim.run_windows(s.windows)
    if result.sent_batches != result.batches or result.rejected_batches:
        raise RuntimeError(f"{run}: sent {result.sent_batches} of {result.batches} batches")
    # For a hang: when the last window before it was handed to the senders.
    fault_time = sent_at.get(s.fault.at - 1) if s.realtime and s.fault is not None else None
    deadline = time.monotonic() + timeout_s
    events: list[dict[str, Any]] = []
    threshold = None
    with httpx.Client(base_url=base_url, timeout=10.0) as c:
        while time.monotonic() < deadline:
            ov = c.get(f"/api/v1/runs/{run}").raise_for_status().json()
            events = c.get(f"/api/v1/runs/{run}/events").raise_for_status().json()
            if s.realtime:
                want = s.expect.key if s.expect else None
                hit = [e for e in events if e["key"] == want]
                if hit:
                    threshold = float(hit[0]["evidence"].get("threshold_s", 0.0))
                    break
            elif (ov.get("analysis") or {}).get("analysed_through_step", 0) >= result.last_step:
                break
            time.sleep(0.2)
    return Outcome(
        s,
        "collector",
        seed,
        _flags_from_events(events),
        rank_windows=result.batches,
        job_windows=result.windows,
        seconds=time.perf_counter() - t0,
        fault_time=fault_time,
        hang_threshold_s=threshold,
    )
