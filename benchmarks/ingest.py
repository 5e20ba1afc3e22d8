"""Ingest at 4,096 simulated ranks: rank-steps/s into PostgreSQL against the same
collector with storage replaced by a no-op (same web stack, same payloads, same run),
POST latency, and the agent-side cost of building one payload.

    python -m benchmarks.ingest [--ranks 4096] [--steps-per-window 64] [--workers 2]

Budgets (DESIGN §7): >= 100,000 rank-steps/s on 2 cores and >= 50% of the no-op rate;
POST p99 <= 100 ms. Phases alternate no-op / PostgreSQL and the medians are reported.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import psycopg

from . import loadgen
from ._harness import median, pg_database, server


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ranks", type=int, default=4096)
    p.add_argument("--steps-per-window", type=int, default=64)
    p.add_argument("--windows", type=int, default=2, help="windows per rank in each phase")
    p.add_argument("--rounds", type=int, default=2, help="no-op/PostgreSQL phase pairs")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=32)
    args = p.parse_args(argv)
    n = args.steps_per_window

    enc_s = loadgen.encoding_cost(loadgen.Fleet("enc", args.ranks, n), samples=2000)
    phases = []
    for i in range(args.rounds):
        for kind in ("null", "pg"):
            fleet = loadgen.Fleet(f"bench-{kind}-{i}", args.ranks, n, seed=i)
            phases.append((kind, fleet.run, list(fleet.payloads(args.windows))))

    results: dict[str, list[loadgen.LoadResult]] = {"null": [], "pg": []}
    workers = ["--workers", str(args.workers)]
    with pg_database() as db_url:
        null_cmd = ["benchmarks.null_collector", *workers]
        pg_cmd = ["stepwatch", "serve", "--database-url", db_url, "--log-level", "warning", *workers]
        with server(null_cmd, "/healthz") as null_url, server(pg_cmd, "/readyz") as pg_url:
            for kind, _, bodies in phases:
                url = null_url if kind == "null" else pg_url
                res = loadgen.post_all(url, bodies, n, concurrency=args.concurrency)
                if res.ok != len(bodies):
                    raise SystemExit(f"{kind}: only {res.ok}/{len(bodies)} answered 2xx: {res.statuses}")
                results[kind].append(res)
        # The PostgreSQL phases really stored every rank-step, once.
        with psycopg.connect(db_url.replace("+psycopg", "")) as conn:
            for kind, run, _ in phases:
                if kind != "pg":
                    continue
                stored = conn.execute(
                    "SELECT sum(ranks), count(*) FROM job_steps JOIN runs ON runs.id = run_id "
                    "WHERE name = %s",
                    (run,),
                ).fetchone()
                assert stored == (args.ranks * args.windows * n, args.windows * n), (run, stored)

    def rate(kind: str) -> float:
        return median([r.steps_acked / r.seconds for r in results[kind]])

    def lat(kind: str, q: float) -> float:
        return median([r.quantile(q) for r in results[kind]]) * 1e3

    pg_rate, null_rate = rate("pg"), rate("null")
    batches = args.ranks * args.windows
    print(
        f"ingest: {args.ranks} ranks x {n}-step windows, {batches} POSTs per phase, "
        f"{args.concurrency} connections, {args.workers} workers"
    )
    print(f"  agent payload encoding:    {enc_s * 1e6:8.1f} us/window  {enc_s / n * 1e9:6.0f} ns/step")
    print(f"  no-op endpoint:            {null_rate:10,.0f} rank-steps/s  p50 {lat('null', 0.5):5.1f} ms")
    print(
        f"  PostgreSQL:                {pg_rate:10,.0f} rank-steps/s  p50 {lat('pg', 0.5):5.1f} ms  "
        f"p99 {lat('pg', 0.99):5.1f} ms"
    )
    ratio = pg_rate / null_rate
    print(f"  ratio PostgreSQL / no-op:  {ratio:6.2f}   (budget >= 0.50; rate budget >= 100,000/s)")
    ok = pg_rate >= 100_000 and ratio >= 0.5 and lat("pg", 0.99) <= 100
    print(f"  budgets: {'met' if ok else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
