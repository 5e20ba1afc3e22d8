"""Ingest at 4,096 simulated ranks: rank-steps/s into PostgreSQL against raw ``COPY`` of
exactly the rows the collector stored for the same payloads (``_copy_baseline.py``, the
DESIGN §7 budget) and against the same collector with storage replaced by a no-op (same
web stack, same payloads, same run), POST latency at the budget rate, the size of a
``job_steps`` row after the run against a freshly copied one, and the agent-side cost of
building one payload.

    python -m benchmarks.ingest [--ranks 4096] [--steps-per-window 64] [--workers 2]
                                [--ranks-per-host 8] [--per-bucket]

Each window is posted as the agent posts it without the collective timing, and (per
host) with the ``comm`` section a DDP rank sends by default (``"-comm"`` phases, against
COPY of their own rows, which include the staged ``step_timings``): ``sw.watch(ddp)``
times DDP's built-in reduction once per step and sends no per-collective sketch;
``--per-bucket`` sends instead what ``sw.watch(ddp, per_bucket=True)`` sends (every
bucket timed, a duration sketch of the window's all-reduces, validated and not stored). Two ways of posting
the same windows are measured: one POST per host and window carrying its ranks' windows
(per-host batching, ``wire.HOST_BATCH_PATH``, the agent's default where the launcher
says a host runs several ranks: ``stepwatch._env.local_world_size``), and one POST per rank and window
(``wire.INGEST_PATH``: a lone process, or ``STEPWATCH_HOST_BATCH=0``): the same payloads,
the same rows stored, one request instead of ``--ranks-per-host``.

Throughput is the closed-loop peak (``--concurrency`` connections, each posting its next
window as soon as the last is answered); phases alternate no-op / PostgreSQL and the
medians are compared. Latency is measured open-loop: windows offered at the budget rate
(100,000 rank-steps/s) over 256 connections, timed from when each was due, to the
collector as ``stepwatch serve`` runs it on PostgreSQL (the analysis worker in its own
process; budgeted), then to one with the worker as a thread of each web worker
(``STEPWATCH_ANALYSIS_MODE=thread``) and to one without it; each kind twice, each time
a fresh collector over a fresh database given the same backlog first: posted to per
rank (batching off), and at the same rank-step rate per host (the default: one POST of
``--ranks-per-host`` windows, a fleet's load as its agents post it by default).
Around each phase the CPU of the collector's processes, of the PostgreSQL server and of
the load generator is read from ``/proc`` (``_cpu.py``) and printed per rank-window, COPY's
beside it: where the gap to COPY is spent.
Budgets (DESIGN §7): >= 30% of the COPY rate; >= 100,000 rank-steps/s on 2 cores and
>= 50% of the no-op rate; POST p99 <= 100 ms at 4,096 ranks; ``job_steps`` within 2x of
its freshly copied size per row.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import psycopg

from stepwatch import wire

from . import loadgen
from ._copy_baseline import CopyLoad, hot_share, table_bytes_per_row
from ._cpu import Meter, Split, postgres_server_pid
from ._harness import median, pg_database, server

RATE_BUDGET = 100_000  # rank-steps/s
RATIO_BUDGET = 0.5
COPY_BUDGET = 0.30
BLOAT_BUDGET = 2.0
P99_BUDGET_S = 0.100
#: New runs each paced-phase collector is given to analyse before its paced windows.
BACKLOG_RUNS = 4


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ranks", type=int, default=4096)
    p.add_argument("--steps-per-window", type=int, default=64)
    p.add_argument("--windows", type=int, default=2, help="windows per rank in each throughput phase")
    p.add_argument("--rounds", type=int, default=3, help="no-op/PostgreSQL phase pairs")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--ranks-per-host", type=int, default=8)
    p.add_argument(
        "--per-bucket", action="store_true", help="the comm section of sw.watch(ddp, per_bucket=True)"
    )
    args = p.parse_args(argv)
    n = args.steps_per_window
    per_host = args.ranks_per_host
    # "-comm": the same per-host windows, each with the comm section a DDP rank sends
    # (``sw.watch(ddp)``, the default with a DDP model): more to validate, and one staged
    # ``step_timings`` row per rank and batch (its steps packed), which the COPY of the
    # same rows holds too.
    kinds = ("null", "pg", "null-host", "pg-host", "null-host-comm", "pg-host-comm")

    enc_s = loadgen.encoding_cost(loadgen.Fleet("enc", args.ranks, n), samples=2000)
    phases = []
    for i in range(args.rounds):
        for kind in kinds:
            comm = kind.endswith("comm")
            fleet = loadgen.Fleet(
                f"bench-{kind}-{i}", args.ranks, n, seed=i, comm=comm, per_bucket=comm and args.per_bucket
            )
            host = "host" in kind
            bodies = fleet.host_payloads(args.windows, per_host) if host else fleet.payloads(args.windows)
            phases.append((kind, fleet.run, list(bodies)))
    # The paced phase, to the collector as served (the analysis worker in its own
    # process), to one with the worker as a thread of each web worker, and to one without
    # it: each fresh, over a fresh database, first given the same backlog to analyse
    # (BACKLOG_RUNS runs, posted per host at the peak rate), then the paced windows.
    paced_kinds = {
        "process": ("the analysis worker in its own process (as served)", {}),
        "thread": ("the analysis worker a thread of each web worker", {"STEPWATCH_ANALYSIS_MODE": "thread"}),
        "none": ("no analysis worker", {"STEPWATCH_ANALYSIS_ENABLED": "false"}),
    }
    paced_res: dict[str, loadgen.LoadResult] = {}
    paced_host: dict[str, loadgen.LoadResult] = {}

    results: dict[str, list[loadgen.LoadResult]] = {k: [] for k in kinds}
    copy_rates: dict[bool, list[float]] = {False: [], True: []}  # by comm section
    # CPU seconds per rank-window of each phase: (collector, PostgreSQL, this process).
    cpu: dict[str, list[Split]] = {k: [] for k in (*kinds, "copy", "copy-comm")}
    workers = ["--workers", str(args.workers)]
    with pg_database() as db_url, pg_database("stepwatch_bench_copy") as copy_url:
        copy_conn = psycopg.connect(copy_url.replace("+psycopg", ""))
        postgres_pid = postgres_server_pid(copy_conn)
        null_cmd = ["benchmarks._null_collector", *workers]
        pg_cmd = ["stepwatch", "serve", "--database-url", db_url, "--log-level", "warning", *workers]
        with server(null_cmd, "/healthz") as null_url, server(pg_cmd, "/readyz") as pg_url:
            for kind, _, bodies in phases:
                url = null_url if kind.startswith("null") else pg_url
                host = "host" in kind
                rank_windows = len(bodies) * (per_host if host else 1)
                meter = Meter(url.pid, postgres_pid)
                meter.start()
                res = loadgen.post_all(
                    url,
                    bodies,
                    n * per_host if host else n,
                    concurrency=args.concurrency,
                    path=wire.HOST_BATCH_PATH if host else wire.INGEST_PATH,
                )
                cpu[kind].append(_per(meter.stop(), rank_windows))
                _check(kind, res, len(bodies))
                results[kind].append(res)
                if kind.startswith("pg"):  # the database's own speed for the same rows, right after
                    load = CopyLoad(bodies)
                    comm = kind.endswith("comm")
                    load.prepare(copy_conn, f"copy-{comm}-{len(copy_rates[comm])}")
                    meter = Meter(None, postgres_pid)
                    meter.start()
                    copy_rates[comm].append(load.rank_steps / load.copy(copy_conn))
                    spent = meter.stop()
                    if kind == "pg" or comm:  # the per-host rows are the per-rank rows again
                        cpu["copy-comm" if comm else "copy"].append(_per(spent, rank_windows))
        with psycopg.connect(db_url.replace("+psycopg", "")) as conn:  # the rows the COPY database holds
            job_bytes = table_bytes_per_row(conn, "job_steps")
            job_hot = hot_share(conn, "job_steps")
            for kind, run, bodies in phases:  # every acknowledged rank-step stored, once
                if kind.startswith("pg"):
                    _check_stored(conn, run, len(bodies) * (per_host if "host" in kind else 1), args)
        for kind, (_, env) in paced_kinds.items():
            paced_res[kind], paced_host[kind] = _paced(kind, env, args)
        copy_job_bytes = table_bytes_per_row(copy_conn, "job_steps")
        copy_conn.close()

    def rate(kind: str) -> float:
        return median([r.steps_acked / r.seconds for r in results[kind]])

    def lat_ms(kind: str, q: float) -> float:
        return median([r.quantile(q) for r in results[kind]]) * 1e3

    copy_rate, comm_copy_rate = median(copy_rates[False]), median(copy_rates[True])
    bloat = job_bytes / copy_job_bytes
    p99, host_p99 = paced_res["process"].quantile(0.99), paced_host["process"].quantile(0.99)
    print(
        f"ingest: {args.ranks} simulated ranks, {n}-step windows, {args.workers} uvicorn workers, "
        f"{args.rounds} rounds per phase of {args.ranks * args.windows} POSTs (one per rank) or "
        f"{args.ranks * args.windows // per_host} (one per host of {per_host} ranks)"
    )
    print(f"  agent payload build+encode   {enc_s * 1e6:9.1f} us/window ({enc_s / n * 1e9:.0f} ns/step)")
    for kind, label in (
        ("null", "no-op endpoint, per rank"),
        ("pg", "PostgreSQL, per rank (batching off)"),
        ("null-host", "no-op endpoint, per host"),
        ("pg-host", "PostgreSQL, per host (the default)"),
        ("null-host-comm", "no-op, per host, with comm"),
        ("pg-host-comm", "PostgreSQL, per host, with comm"),
    ):
        print(
            f"  {label + ' (peak)':<42} {rate(kind):11,.0f} rank-steps/s"
            f"   POST p50 {lat_ms(kind, 0.5):5.1f} ms  p99 {lat_ms(kind, 0.99):5.1f} ms"
        )
    for kind, (label, _) in paced_kinds.items():
        for res, how in ((paced_res[kind], "per rank"), (paced_host[kind], "per host")):
            print(
                f"  PostgreSQL at {RATE_BUDGET:,} rank-steps/s offered ({how}), {label}: achieved "
                f"{res.steps_acked / res.seconds:,.0f}, POST p50 {res.quantile(0.5) * 1e3:.1f} ms"
                f"  p99 {res.quantile(0.99) * 1e3:.1f} ms"
            )
    print(f"  raw COPY of the same rows          {copy_rate:11,.0f} rank-steps/s (one transaction per phase)")
    pg_rate, host_rate = rate("pg"), rate("pg-host")
    copy_ratio, host_copy_ratio = pg_rate / copy_rate, host_rate / copy_rate
    ratio, host_ratio = pg_rate / rate("null"), host_rate / rate("null-host")
    print(f"  ratio PostgreSQL / COPY            {copy_ratio:9.3f} per rank, {host_copy_ratio:.3f} per host")
    print(f"  ratio PostgreSQL / no-op           {ratio:9.2f} per rank, {host_ratio:.2f} per host")
    # The web tier's own ceiling: storage replaced by a no-op, the same payloads. No
    # database path can lift the collector above it.
    print(
        f"  ratio no-op / COPY                 {rate('null') / copy_rate:9.3f} per rank, "
        f"{rate('null-host') / copy_rate:.3f} per host (the ceiling without any storage)"
    )
    comm_rate = rate("pg-host-comm")
    sent = "sw.watch(ddp, per_bucket=True)" if args.per_bucket else "sw.watch(ddp), the default"
    print(
        f"  with the comm section of {sent}, per host: COPY of the same rows (step_timings too) "
        f"{comm_copy_rate:,.0f} rank-steps/s; PostgreSQL / COPY {comm_rate / comm_copy_rate:.3f}, "
        f"no-op / COPY {rate('null-host-comm') / comm_copy_rate:.3f}, PostgreSQL / no-op "
        f"{comm_rate / rate('null-host-comm'):.2f}"
    )
    print(_cpu_lines(cpu, kinds))
    print(
        f"  job_steps after the run            {job_bytes:9.0f} B/row, "
        f"freshly copied {copy_job_bytes:.0f} B/row ({bloat:.2f}x; {job_hot:.0%} of its updates HOT)"
    )
    checks = {
        f"COPY ratio >= {COPY_BUDGET} per host": host_copy_ratio >= COPY_BUDGET,
        f"COPY ratio >= {COPY_BUDGET} per rank (host batching off)": copy_ratio >= COPY_BUDGET,
        f"COPY ratio >= {COPY_BUDGET} per host with comm": comm_rate / comm_copy_rate >= COPY_BUDGET,
        f"rate >= {RATE_BUDGET:,}/s per rank": pg_rate >= RATE_BUDGET,
        f"ratio >= {RATIO_BUDGET} per rank": ratio >= RATIO_BUDGET,
        "POST p99 <= 100 ms per host (the default)": host_p99 <= P99_BUDGET_S,
        "POST p99 <= 100 ms per rank (host batching off)": p99 <= P99_BUDGET_S,
        f"job_steps <= {BLOAT_BUDGET}x": bloat <= BLOAT_BUDGET,
    }
    print("  budgets: " + ", ".join(f"{k} {'ok' if v else 'MISSED'}" for k, v in checks.items()))
    return 0


_CPU_LABELS = {
    "null": "no-op endpoint, per rank",
    "pg": "PostgreSQL, per rank",
    "null-host": "no-op endpoint, per host",
    "pg-host": "PostgreSQL, per host",
    "null-host-comm": "no-op, per host, with comm",
    "pg-host-comm": "PostgreSQL, per host, with comm",
    "copy": "raw COPY of the same rows",
    "copy-comm": "raw COPY, with comm (step_timings)",
}


def _per(spent: Split, n: int) -> Split:
    """CPU seconds of a phase as microseconds per rank-window."""
    return (
        None if spent[0] is None else spent[0] / n * 1e6,
        None if spent[1] is None else spent[1] / n * 1e6,
        spent[2] / n * 1e6,
    )


def _cpu_lines(cpu: dict[str, list[Split]], kinds: Sequence[str]) -> str:
    """Where each phase's CPU went, per rank-window (median of the rounds): the collector's
    processes (web workers, analysis), the PostgreSQL server's, and this process's (the load
    generator; for COPY, its client). Throughput is bounded by the sum on the 2 cores."""

    def cell(values: list[float | None]) -> str:
        known = [v for v in values if v is not None]
        return f"{median(known):8.1f}" if known and len(known) == len(values) else f"{'-':>8}"

    lines = ["  CPU per rank-window, us (median of rounds)   collector  PostgreSQL  load generator / client"]
    for kind in (*kinds, "copy", "copy-comm"):
        rows = cpu[kind]
        if not rows:
            continue
        collector = cell([r[0] for r in rows]) if not kind.startswith("copy") else f"{'-':>8}"
        postgres, client = cell([r[1] for r in rows]), cell([r[2] for r in rows])
        lines.append(f"    {_CPU_LABELS[kind]:<42} {collector}   {postgres}   {client}")
    return "\n".join(lines)


def _paced(
    kind: str, env: dict[str, str], args: argparse.Namespace
) -> tuple[loadgen.LoadResult, loadgen.LoadResult]:
    """The paced windows of this collector kind, per rank and per host: each mode to a
    fresh collector over a fresh database, once it was given the same backlog, so that
    neither inherits the other's analysis or rows; every acknowledged rank-step checked
    stored, once. The same rank-steps at the same rate either way (a host batch carries
    ``--ranks-per-host`` windows, so per host has that many times fewer POSTs to time)."""
    n, per_host = args.steps_per_window, args.ranks_per_host
    paced = loadgen.Fleet("bench-paced", args.ranks, n, seed=99)
    per_rank = _paced_one(kind, env, args, paced, list(paced.payloads(args.windows)), n, wire.INGEST_PATH)
    per_host_result = _paced_one(
        kind,
        env,
        args,
        paced,
        list(paced.host_payloads(args.windows, per_host)),
        n * per_host,
        wire.HOST_BATCH_PATH,
    )
    return per_rank, per_host_result


def _paced_one(
    kind: str,
    env: dict[str, str],
    args: argparse.Namespace,
    paced: loadgen.Fleet,
    bodies: list[bytes],
    steps_per_body: int,
    path: str,
) -> loadgen.LoadResult:
    n, per_host = args.steps_per_window, args.ranks_per_host
    backlog = [loadgen.Fleet(f"bench-backlog-{j}", args.ranks, n, seed=j) for j in range(BACKLOG_RUNS)]
    backlog_bodies = [list(f.host_payloads(args.windows, per_host)) for f in backlog]
    with pg_database("stepwatch_bench_paced") as db_url:
        cmd = ["stepwatch", "serve", "--database-url", db_url, "--log-level", "warning"]
        with server([*cmd, "--workers", str(args.workers)], "/readyz", env=env) as url:
            for backlog_run in backlog_bodies:
                res = loadgen.post_all(
                    url, backlog_run, n * per_host, concurrency=args.concurrency, path=wire.HOST_BATCH_PATH
                )
                _check(f"backlog, {kind}", res, len(backlog_run))
            result = loadgen.post_at_rate(
                url, bodies, steps_per_body, rate=RATE_BUDGET / steps_per_body, path=path
            )
            _check(f"paced, {kind}, {path}", result, len(bodies))
        with psycopg.connect(db_url.replace("+psycopg", "")) as conn:
            for fleet, backlog_run in zip(backlog, backlog_bodies, strict=True):
                _check_stored(conn, fleet.run, len(backlog_run) * per_host, args)
            _check_stored(conn, paced.run, len(bodies) * steps_per_body // n, args)
    return result


def _check_stored(
    conn: psycopg.Connection[Any], run: str, rank_windows: int, args: argparse.Namespace
) -> None:
    """Every acknowledged rank-step of ``run`` stored, once."""
    n = args.steps_per_window
    stored = conn.execute(
        "SELECT sum(ranks), count(*) FROM job_steps JOIN runs ON runs.id = run_id WHERE name = %s", (run,)
    ).fetchone()
    windows = rank_windows // args.ranks
    assert stored == (args.ranks * windows * n, windows * n), (run, stored)


def _check(kind: str, res: loadgen.LoadResult, expected: int) -> None:
    if res.ok != expected:
        raise SystemExit(f"{kind}: only {res.ok}/{expected} answered 2xx: {res.statuses}")


if __name__ == "__main__":
    raise SystemExit(main())
