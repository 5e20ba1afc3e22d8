"""The benchmarks still run (tiny sizes): ``make bench`` must not rot between releases.
The figures themselves are printed by the benchmarks, never asserted here; what is
asserted is that their verdicts can fail (given figures with a known slowdown)."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest

from benchmarks import (
    _cpu,
    agent_overhead,
    analysis_passes,
    collective_counting,
    comm_payload,
    comm_timing,
    ingest,
    loadgen,
    metrics_scrape,
    profiler_window,
    query,
    run_listing,
)
from benchmarks.__main__ import discover
from stepwatch.profiler._window import PRIOR_COST_S, stretch
from stepwatch_server.schemas.ingest import IngestBatches, IngestPayload
from tests import pg


def test_every_benchmark_is_discovered() -> None:
    assert {
        "agent_overhead",
        "analysis_passes",
        "collective_counting",
        "comm_payload",
        "comm_timing",
        "hot_path",
        "ingest",
        "metrics_scrape",
        "profiler_window",
        "query",
        "run_listing",
    } <= set(discover())


def test_load_generator_payloads_are_valid_batches() -> None:
    fleet = loadgen.Fleet("lg", ranks=16, steps_per_window=8)
    batches = [IngestPayload.model_validate_json(b) for b in fleet.payloads(windows=2)]
    assert len(batches) == 32 and len({b.batch_id for b in batches}) == 32
    assert [(b.rank.rank, b.steps.first) for b in batches[15:17]] == [(15, 1), (0, 9)]


def test_host_bodies_carry_the_same_windows_one_host_each() -> None:
    per_rank = [IngestPayload.model_validate_json(b) for b in loadgen.Fleet("lg", 16, 8).payloads(2)]
    fleet = loadgen.Fleet("lg", 16, 8)
    hosts = [IngestBatches.model_validate_json(b).batches for b in fleet.host_payloads(2)]
    assert len(hosts) == 4 and all(len({p.rank.host for p in h}) == 1 and len(h) == 8 for h in hosts)
    flat = [p for h in hosts for p in h]
    assert [(p.rank.rank, p.steps.first, p.steps.time_s) for p in flat] == [
        (p.rank.rank, p.steps.first, p.steps.time_s) for p in per_rank
    ]


@pytest.mark.parametrize(
    ("bench", "args", "says"),
    [
        (
            ingest,
            ["--ranks", "32", "--steps-per-window", "8", "--windows", "1", "--rounds", "1", "--workers", "1"],
            # The paced latency of both posting modes, each judged against the p99 budget.
            (
                "ratio",
                "offered (per rank)",
                "offered (per host)",
                "POST p99 <= 100 ms per host (the default)",
                "POST p99 <= 100 ms per rank (host batching off)",
            ),
        ),
        (query, ["--days", "1", "--ranks", "16"], "run overview"),
        (run_listing, ["--runs", "120"], "scrape_s"),
        (
            metrics_scrape,
            ["--ranks", "8,16", "--scrapes", "1", "--rounds", "1"],
            "live run (a window stored and analysed",
        ),
        (collective_counting, ["--rounds", "1", "--calls", "20"], "counted/plain"),
        (
            analysis_passes,
            ["--ranks", "16", "--runs", "2", "--passes", "1", "--window-runs", "1", "--window-rounds", "1"],
            "analysis / storage",
        ),
    ],
    ids=["ingest", "query", "run_listing", "metrics_scrape", "collective_counting", "analysis_passes"],
)
def test_benchmark_runs(
    bench: object, args: list[str], says: str | tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench.main(args) == 0  # type: ignore[attr-defined]
    out = capsys.readouterr().out
    assert [s for s in ((says,) if isinstance(says, str) else says) if s not in out] == [], out


def test_analysis_passes_budget_is_missed_when_an_idle_pass_reads_the_rows_again() -> None:
    assert analysis_passes.within_budget(30.0, 108.0)
    assert not analysis_passes.within_budget(100.0, 108.0)  # every pass reading every rank row


def _rounds(
    aa: list[float], agent: list[float], config: str = agent_overhead.NO_WINDOW
) -> dict[str, list[dict[str, Any]]]:
    """Per-round pairs of 30 ms steps: the second no-agent job and the agent job as
    ratios to the no-agent job beside each."""
    base = {"wall_s": 0.030, "cpu_s": 0.030}
    return {
        config: [{"wall_s": 0.030 * x, "cpu_s": 0.030 * x, "base": base, "stats": []} for x in agent],
        agent_overhead.AGAIN: [{"wall_s": 0.030 * x, "cpu_s": 0.030 * x, "base": base} for x in aa],
    }


def _job(step_s: list[float], start: float = 0.0) -> list[dict[str, Any]]:
    """Two ranks' ``--out`` of a job whose steps took ``step_s``, half of it CPU time."""
    ends = [start + sum(step_s[: i + 1]) for i in range(len(step_s))]
    return [{"step_ends": ends, "cpu_ends": [e / 2 for e in ends]} for _ in range(2)]


def test_overhead_pairs_count_only_the_steps_both_jobs_ran_together() -> None:
    """The agent job runs 10% slower while beside the no-agent job; once that one has
    finished, alone on the machine, it runs twice as fast. Only the shared steps count:
    over all of its steps it would seem faster than the job beside it."""
    base = _job([0.1] * 300)  # ends at 30 s
    agent = _job([0.11] * 273 + [0.05] * 327)
    together = agent_overhead.measured_together({"base": base, "agent": agent})
    assert together["agent"]["wall_s"] / together["base"]["wall_s"] == pytest.approx(1.1, rel=1e-6)
    assert together["agent"]["cpu_s"] / together["base"]["cpu_s"] == pytest.approx(1.1, rel=1e-3)
    late = _job([0.1] * 300, start=20.0)  # started after the other had finished
    with pytest.raises(ValueError, match="steps together"):
        agent_overhead.measured_together({"base": _job([0.1] * 120), "agent": late})


def test_overhead_pins_the_ranks_of_each_job_alike_with_their_threads() -> None:
    """Rank r of each job on core r, every thread the rank has by then: two real
    processes, one of them with a second thread already running."""
    code = (
        "import sys, threading, time; threading.Thread(target=time.sleep, args=(600,)).start();"
        " print('up', flush=True); sys.stdin.read()"
    )
    run = [sys.executable, "-c", code]
    procs = [subprocess.Popen(run, stdin=subprocess.PIPE, stdout=subprocess.PIPE) for _ in range(2)]
    try:
        for p in procs:  # each has its second thread once it says so
            assert p.stdout is not None and p.stdout.readline() == b"up\n"
        tasks = [f"/proc/{p.pid}/task" for p in procs]
        assert all(len(os.listdir(t)) == 2 for t in tasks)
        agent_overhead.pin_alike([p.pid for p in procs])
        cores = sorted(os.sched_getaffinity(0))
        for r, t in enumerate(tasks):
            assert {frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(t)} == {
                frozenset({cores[r % len(cores)]})
            }
    finally:
        for p in procs:
            p.kill()
            p.wait()
    agent_overhead.pin_alike([procs[0].pid])  # gone: left alone, no error


def test_overhead_verdict_flags_an_injected_3_percent_slowdown() -> None:
    quiet = [1.002, 0.998, 1.001, 0.999, 1.003, 0.997]
    slowed = agent_overhead.verdict(_rounds(quiet, [1.031, 1.029, 1.030, 1.032, 1.028, 1.030]))
    assert slowed["resolves"] and not slowed["met"]
    assert slowed["worst"]["wall_s"] == pytest.approx(0.0305, abs=1e-3)
    fine = agent_overhead.verdict(_rounds(quiet, [1.004, 1.006, 1.005, 1.003, 1.007, 1.005]))
    assert fine["resolves"] and fine["met"]


def test_overhead_verdict_says_when_its_band_cannot_resolve_2_percent() -> None:
    noisy = [1.06, 0.95, 1.04, 0.96]
    v = agent_overhead.verdict(_rounds(noisy, [1.03, 1.03, 1.03, 1.03]))
    assert not v["resolves"] and v["band"]["wall_s"] > 0.02 and not v["met"]
    assert not v["missed"]  # 3% is inside 1% plus that band: unknown, not missed


def test_overhead_verdict_misses_an_excess_beyond_even_a_wide_band() -> None:
    noisy = [1.06, 0.95, 1.04, 0.96]
    rounds = _rounds(noisy, [1.12, 1.10, 1.11, 1.12])
    v = agent_overhead.verdict(rounds)
    assert not v["resolves"] and v["missed"] and not v["met"]
    runs = {config: [{**r, "stats": []} for r in rs] for config, rs in rounds.items()}
    args = SimpleNamespace(steps=900, rounds=4, inject_slowdown=0.0, profile_every=200)
    (line,) = [x for x in agent_overhead.report(runs, v, args) if x.startswith("  budget")]
    assert "MISSED" in line and "+1" in line, line


def test_overhead_band_is_a_configurations_own_spread_where_wider() -> None:
    """No agent beside no agent agrees within 0.3%, but the agent's own pairs spread by
    5%: their median of +2% is not a miss (nor a pass) on so few rounds."""
    quiet = [1.002, 0.998, 1.001, 0.999]
    v = agent_overhead.verdict(_rounds(quiet, [1.00, 1.05, 0.99, 1.04]))
    assert v["band"]["wall_s"] < 0.005 and v["bands"][(agent_overhead.NO_WINDOW, "wall_s")] > 0.02
    assert not v["resolves"] and not v["missed"] and not v["met"]


def _window_rounds(up: float, own_s: float) -> dict[str, list[dict[str, Any]]]:
    """Three rounds: the window-less agent at no cost, the agent with 4 windows a rank at
    ``up`` times the step, the agent's own estimate of a window ``own_s``."""
    stats = [{"profile": {"windows": 4, "every": 200, "last_cost": {"window_s": own_s}}} for _ in range(2)]
    quiet = [1.001, 0.999, 1.0]
    rounds = _rounds(quiet, [1.0, 1.0, 1.0])
    base = {"wall_s": 0.030, "cpu_s": 0.030}
    rounds[agent_overhead.UP] = [
        {"wall_s": 0.030 * up, "cpu_s": 0.030 * up, "base": base, "stats": stats}
    ] * 3
    return rounds


def test_overhead_window_is_judged_at_the_default_period_and_against_its_own_estimate() -> None:
    """+4% over 880 steps of 30 ms in 4 windows: 264 ms a window, 0.44% of 2,000 steps."""
    v = agent_overhead.verdict(_window_rounds(1.04, own_s=0.25), steps=900)["window"]
    assert v["wall_s"] == pytest.approx(0.264) and v["wall_s_default"] == pytest.approx(0.0044)
    assert v["met"] and v["agrees"]
    assert not agent_overhead.verdict(_window_rounds(1.04, own_s=0.05), steps=900)["window"]["agrees"]
    assert not agent_overhead.verdict(_window_rounds(1.20, own_s=1.3), steps=900)["window"]["met"]
    runs = _window_rounds(1.20, own_s=0.05)
    args = SimpleNamespace(steps=900, rounds=3, inject_slowdown=0.0, profile_every=200)
    lines = [x for x in agent_overhead.report(runs, agent_overhead.verdict(runs, 900), args) if "window" in x]
    assert any("+1320 ms wall" in x and "estimate 50 ms: MISSED" in x for x in lines), lines
    assert any("2.20% wall" in x and "budget <= 1% with the band: MISSED" in x for x in lines), lines


def test_profiler_self_estimate_is_checked_against_the_in_run_excess() -> None:
    figures = {
        "pairs": [(10.0, 9.9, 20.0, 19.8)],
        "median_ratio": 1.01,
        "median_cpu_ratio": 1.01,
        "windows_per_run": 1.0,
        "every": [400],
        "cost_per_window_s": 0.1,
        "self_measured_ratio": 0.0075,
        "self_measured_ratio_in_force": 0.0075,
        "in_run_excess_ratio": 0.0319,
    }
    assert any("under by 4.3x" in line and "MISSED" in line for line in profiler_window.report(figures))
    figures["self_measured_ratio"] = 0.025
    assert any("within 2x): met" in line for line in profiler_window.report(figures))


def test_the_profiler_benchmark_runs_long_enough_for_the_period_the_agent_will_use() -> None:
    """Sized from the measured step time: the period the agent stretches to before its
    first window (its own rule, fed its prior cost and the step time it may read: a fifth
    faster to half slower than measured) leaves the first window, its steps and the
    neighbours the in-run excess needs inside the run. With 450 steps fixed, 20 ms steps
    gave a period of 800 and no window."""
    for step_s in (0.005, 0.02, 0.03, 0.05, 0.2):
        every, steps = profiler_window.steps_for(step_s)
        for seen_s in (step_s * 0.8, step_s, step_s * 1.5):
            first = profiler_window.PERIOD * stretch(profiler_window.PERIOD, PRIOR_COST_S, 0.01, seen_s)
            assert first <= every, (step_s, seen_s, first, every)
            assert steps >= first + 2 + profiler_window.AFTER + profiler_window.NEIGHBOURS, (step_s, steps)
    assert profiler_window.steps_for(0.02) == (800, 850)  # the run that fired no window at 450


def test_read_budgets_can_be_missed() -> None:
    """The query and scrape verdicts fail a figure over its absolute budget or more than
    2x its same-run baseline (and pass one within both)."""
    assert query.verdict(0.030, 0.050) == (pytest.approx(50 / 30), True)
    assert not query.verdict(0.030, 0.070)[1]  # 2.3x the 1-day figure
    assert not query.verdict(0.090, 0.120)[1]  # over 100 ms
    assert metrics_scrape.verdict(0.040, 0.070)[1]
    assert not metrics_scrape.verdict(0.040, 0.090)[1]
    assert not metrics_scrape.verdict(0.150, 0.210)[1]


def _cycles(
    factors: dict[str, float], noise: float, n: int = 400, seed: int = 0
) -> dict[str, list[dict[str, float]]]:
    """Paired cycles of 150 ms steps (600 ms CPU over the ranks): each configuration's
    step is the built-in's times its factor, each with its own per-step noise (relative
    sd ``noise``) and a drift shared by the cycle (which the pairing cancels)."""
    rng = random.Random(seed)
    out: dict[str, list[dict[str, float]]] = {c: [] for c in comm_timing.CONFIGS}
    for _ in range(n):
        drift = 1 + 0.2 * rng.random()
        for c in comm_timing.CONFIGS:
            f = factors.get(c, 1.0) * drift
            out[c].append(
                {
                    "wall": 0.150 * f * (1 + rng.gauss(0, noise)),
                    "cpu": 0.6 * f * (1 + rng.gauss(0, noise)),
                    "thread": 0.5 * f * (1 + rng.gauss(0, noise)),
                }
            )
    return out


def test_comm_timing_verdict_misses_a_3_percent_hook_and_sees_the_control() -> None:
    v = comm_timing.verdict(_cycles({comm_timing.TIMED: 1.03, comm_timing.CONTROL: 1.02}, noise=0.02))
    assert all(v["resolves"].values()) and v["overall"] == "MISSED"
    assert v["est"][comm_timing.CONTROL]["cpu"][0] == pytest.approx(1.02, abs=0.006)
    fine = comm_timing.verdict(_cycles({comm_timing.TIMED: 1.002, comm_timing.CONTROL: 1.02}, noise=0.02))
    assert fine["overall"] == "met"


def test_comm_timing_verdict_is_inconclusive_when_noise_hides_2_percent() -> None:
    """Per-step noise of 30% (4 ranks on 2 loaded cores) over 60 cycles: neither a 3% hook
    nor a clean one gets a verdict, and the band says why."""
    factors = {comm_timing.TIMED: 1.03, comm_timing.CONTROL: 1.02}
    v = comm_timing.verdict(_cycles(factors, noise=0.3, n=60))
    assert not any(v["resolves"].values()) and v["overall"] == "inconclusive"
    assert v["band"]["wall"] > 0.01


def test_comm_timing_verdict_needs_the_control_detected() -> None:
    """A quiet run whose control shows no slowdown cannot vouch for the budget."""
    v = comm_timing.verdict(_cycles({comm_timing.TIMED: 1.0, comm_timing.CONTROL: 1.0}, noise=0.02))
    assert v["band"]["cpu"] < 0.01 and not any(v["resolves"].values())
    assert v["overall"] == "inconclusive"


def test_median_interval_covers_the_median_by_order_statistics() -> None:
    med, lo, hi = comm_timing.median_ci([float(x) for x in range(100)])
    assert med == 49.5 and (lo, hi) == (39.0, 60.0)
    assert comm_timing.median_ci([1.0, 2.0, 3.0])[1] == -math.inf  # too few for an interval


def test_direct_cost_verdict_scales_per_bucket_cost_to_the_step() -> None:
    """The isolated phase: 10 buckets, 60 ms of a rank's CPU per 4-rank step of 20
    buckets. The per-bucket configurations' cost doubles there; the per-step timing's
    (``timed``, what the verdict is about) does not."""

    def iso(timed_us: float, control_us: float) -> dict[str, object]:
        per_step = {c: us * 10e-6 for c, us in ((comm_timing.PYHOOK, 30.0), (comm_timing.PER_BUCKET, 31.0))}
        per_step[comm_timing.TIMED] = timed_us * 1e-6
        per_step[comm_timing.CONTROL] = (30.0 + control_us) * 10e-6
        per_step[comm_timing.AGAIN] = per_step[comm_timing.NO_THEN] = 0.0
        return {"buckets": 10, "diff": {c: (x, x - 5e-6, x + 5e-6) for c, x in per_step.items()}}

    met = comm_timing.direct_verdict(iso(400.0, 20.0), 20, 0.060)  # 0.67%
    assert met["budget"] == "met"
    assert met["fraction"][comm_timing.PER_BUCKET][0] == pytest.approx(2 * 310e-6 / 0.060)
    over = comm_timing.direct_verdict(iso(900.0, 20.0), 20, 0.060)  # 1.5%
    assert over["budget"] == "MISSED" and over["fraction"][comm_timing.TIMED][0] == pytest.approx(0.015)
    blind = comm_timing.direct_verdict(iso(900.0, 2.0), 20, 0.060)  # the control was not seen
    assert not blind["control_works"] and blind["budget"] == "inconclusive"


def test_comm_payload_splits_the_section_into_per_step_and_per_window_bytes() -> None:
    """Two windows (4 and 8 steps) whose comm section has 3 per-step arrays and a fixed
    rest: the growth is the section's encoded bytes, the per-step part its arrays'."""

    def body(n: int) -> dict[str, object]:
        comm: dict[str, object] = {k: [123456] * n for k in ("arrive_us", "sync_us", "cpu_us")}
        comm.update(version=2, clock="host", collectives=[], groups=[{"group": "world", "entered": 9}])
        return {"run": "r", "steps": {"first": 1, "time_s": [0.2] * n}, "comm": comm}

    f = comm_payload.payload_bytes([body(4), body(8)])
    per_value = len("123456,")
    assert f["per_step"] == pytest.approx(3 * per_value, abs=1)  # n values, n - 1 commas
    assert f["growth"] == pytest.approx(f["fixed"] + f["per_step"] * 6, abs=1)
    assert 60 < f["fixed"] < 160


def test_comm_timing_pools_runs_to_resolve_what_one_run_cannot() -> None:
    """Four noisy runs of 50 cycles give no verdict each; pooled, their 200 paired cycles
    resolve the control and clear a per-step timing that costs nothing."""
    factors = {comm_timing.TIMED: 1.0, comm_timing.CONTROL: 1.03}
    runs = [_cycles(factors, noise=0.02, n=50, seed=s) for s in range(4)]
    assert all(comm_timing.verdict(r)["overall"] == "inconclusive" for r in runs)
    pooled = comm_timing.pool(runs)
    assert len(pooled[comm_timing.BASE]) == 200
    assert comm_timing.verdict(pooled)["overall"] == "met"


# A process that burns CPU until its own clock says so, then says it did; then waits.
_BURN = (
    "import sys, time\nwhile time.process_time() < 0.4: pass\nprint('burned', flush=True)\nsys.stdin.read()\n"
)
_PARENT = f"""
import subprocess, sys
burn = {_BURN!r}
kids = []
for _ in range(2):
    kid = subprocess.Popen(
        [sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    kid.stdout.readline()
    kids.append(kid)
kids[0].stdin.close(); kids[0].wait()  # exited and reaped: its CPU is in the parent's
print("ready", flush=True)
sys.stdin.read()
kids[1].stdin.close(); kids[1].wait()
"""


def test_the_cpu_split_counts_a_tree_with_its_exited_children_and_the_local_postgres() -> None:
    """The ingest benchmark's CPU split (``_cpu``) reads a process tree: a child's live
    grandchild and one that exited (counted through its parent) both count."""
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert parent.stdout is not None and parent.stdout.readline() == b"ready\n"
        total = _cpu.tree_cpu_s(parent.pid)
        # Two grandchildren of 0.4 s each, less /proc's clock ticks (each of its user and
        # system times truncated to 10 ms): one left out would leave about 0.45 s.
        assert total is not None and total >= 0.7, total
    finally:
        assert parent.stdin is not None
        parent.stdin.close()
        parent.wait(timeout=60)
    assert _cpu.tree_cpu_s(parent.pid) is None  # gone: unreadable, not zero
    # The suite's PostgreSQL runs on this machine: its server's CPU is read, and a query
    # that scans ten million rows shows in it (a backend is a child of the server).
    with pg.admin_url() as admin, psycopg.connect(admin) as conn:
        server = _cpu.postgres_server_pid(conn)
        local = conn.info.host in ("127.0.0.1", "localhost", "::1") or conn.info.host.startswith("/")
        assert (server is not None) == local, (conn.info.host, server)
        if server is not None:
            meter = _cpu.Meter(None, server)
            meter.start()
            conn.execute("SELECT count(*) FROM generate_series(1, 10000000)").fetchone()
            collector, postgres, _ = meter.stop()
            assert collector is None and postgres is not None and postgres >= 0.05, postgres
