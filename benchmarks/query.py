"""Read path at scale: 1 day and 30 days of a 4,096-rank run at 10 s per step, in PostgreSQL.

    python -m benchmarks.query [--days 30] [--ranks 4096]

The data is generated in SQL (``generate_series``), not through the API: for each run
its job steps (259,200 at 30 days), 4,096 ranks, and per-rank windows as the retention
policy leaves them (the last hour at full resolution, older windows rolled up to one per
hour: ``stepwatch db prune``), and the job-step buckets as ingest keeps them
(``storage/rollups.py``). Then the collector (a real ``stepwatch serve`` process) answers
the run overview, the series (whole run, MFU, and a zoomed day) and the per-rank table of
both runs; each figure is the median of 10 requests after one warm-up. Budget (DESIGN §7,
issue #16): <= 100 ms at 30 days, and <= 2x the 1-day run's figure measured in the same
run (flat in history).
Also prints the measured storage per rank-window row (heap + index) and what a month of
a 4,096-rank run costs with and without the rollup.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import httpx
import psycopg
from sqlalchemy.dialects import postgresql

from stepwatch_server.storage import rollups
from stepwatch_server.storage.engine import make_engine

from ._harness import median, pg_database, server

STEP_S = 10.0
ROLLUP = 360  # windows per rolled-up row: one hour of 10 s windows
BUDGET_S = 0.100
#: The longest run's figure against the 1-day run's.
BUDGET_RATIO = 2.0


def _generate(
    conn: psycopg.Connection[tuple[object, ...]], name: str, days: int, ranks: int
) -> tuple[int, int]:
    steps = int(days * 86400 / STEP_S)
    full_from = steps - ROLLUP  # the last hour stays at full resolution
    conn.execute("SET synchronous_commit = off")
    (run_id,) = conn.execute(
        """INSERT INTO runs (name, world_size, dp_size, layout, convention, window_steps, created_at)
           VALUES (%(name)s, %(r)s, %(r)s, %(layout)s, %(conv)s, 1, now()) RETURNING id""",
        {
            "name": name,
            "r": ranks,
            "layout": f'{{"dp": {ranks}, "tp": 1, "pp": 1, "cp": 1, "ep": 1}}',
            "conv": '{"formula": "6N", "flops_per_token": 4.8e10, "peak_flops": 9.894e14, "dtype": "bf16"}',
        },
    ).fetchone()  # type: ignore[misc]
    t0 = time.time() - steps * STEP_S
    conn.execute(
        """INSERT INTO job_steps (run_id, step, ranks, token_ranks, step_time_sum, step_time_max,
                                  data_wait_max, tokens, padded_tokens, tag, wall_end)
           SELECT %(run)s, s, %(r)s, %(r)s, %(r)s * (10.0 + 0.3 * sin(s / 500.0)),
                  10.6 + 0.3 * sin(s / 500.0), 0.02, %(r)s::bigint * 32768, NULL,
                  CASE WHEN s <= 10 THEN 1 ELSE 0 END, %(t0)s + s * 10.0
           FROM generate_series(1, %(steps)s) AS s""",
        {"run": run_id, "r": ranks, "steps": steps, "t0": t0},
    )
    conn.execute(
        """INSERT INTO ranks (run_id, rank, host, local_rank, coords, last_step, last_seen, agent_version,
                              clock, dropped_windows, dropped_steps, hot_path_mean_s)
           SELECT %(run)s, r, 'node' || lpad((r / 8)::text, 5, '0'), r %% 8,
                  json_build_object('dp', r), %(steps)s, now(), '0.1.0', 'cuda_events', 0, 0, 4e-7
           FROM generate_series(0, %(r)s - 1) AS r""",
        {"run": run_id, "r": ranks, "steps": steps},
    )
    # Rolled-up windows (one row per rank per hour), then the last hour at full resolution.
    conn.execute(
        """INSERT INTO rank_windows (run_id, rank, "window", first_step, last_step, n_steps, step_time_sum,
                                     step_time_min, step_time_max, data_wait_sum, tokens_sum, wall_end)
           SELECT %(run)s, r, h * %(k)s, h * %(k)s + 1, (h + 1) * %(k)s, %(k)s, %(k)s * 10.0, 9.8, 10.9,
                  %(k)s * 0.01, %(k)s * 32768, %(t0)s + (h + 1) * %(k)s * 10.0
           FROM generate_series(0, %(r)s - 1) AS r, generate_series(0, %(full)s / %(k)s - 1) AS h""",
        {"run": run_id, "r": ranks, "k": ROLLUP, "full": full_from, "t0": t0},
    )
    conn.execute(
        """INSERT INTO rank_windows (run_id, rank, "window", first_step, last_step, n_steps, step_time_sum,
                                     step_time_min, step_time_max, data_wait_sum, tokens_sum, wall_end)
           SELECT %(run)s, r, w, w + 1, w + 1, 1, 10.0 + r %% 7 * 0.01, 10.0, 10.1, 0.01, 32768,
                  %(t0)s + (w + 1) * 10.0
           FROM generate_series(0, %(r)s - 1) AS r, generate_series(%(full)s, %(steps)s - 1) AS w""",
        {"run": run_id, "r": ranks, "full": full_from, "steps": steps, "t0": t0},
    )
    conn.commit()
    return int(run_id), steps  # type: ignore[call-overload]


def _buckets(url: str, run_id: int) -> None:
    """The job-step buckets ingest would have kept for the generated steps."""
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            rollups.rebuild(conn, postgresql.insert, run_id)
    finally:
        engine.dispose()


def _paired(client: httpx.Client, paths: list[tuple[str, dict[str, object]]], n: int = 10) -> list[float]:
    """Median seconds of each request, the requests interleaved (one of each per round)
    after a warm-up of each, so that a change of the machine's load hits all alike."""
    for path, params in paths:
        client.get(path, params=params).raise_for_status()
    samples: list[list[float]] = [[] for _ in paths]
    for _ in range(n):
        for i, (path, params) in enumerate(paths):
            t0 = time.perf_counter()
            client.get(path, params=params).raise_for_status()
            samples[i].append(time.perf_counter() - t0)
    return [median(x) for x in samples]


def _requests(name: str, steps: int) -> dict[str, tuple[str, dict[str, object]]]:
    run = f"/api/v1/runs/{name}"
    day = int(86400 / STEP_S)
    return {
        "run overview": (run, {}),
        "series, step time whole run (500 points)": (f"{run}/series", {"metric": "step_time_s"}),
        "series, MFU whole run": (f"{run}/series", {"metric": "mfu"}),
        "series, tokens/s last day zoomed": (
            f"{run}/series",
            {"metric": "tokens_per_s", "from_step": max(1, steps - day), "to_step": steps},
        ),
        "ranks (latest window of every rank)": (f"{run}/ranks", {}),
    }


def verdict(short: float, long: float) -> tuple[float, bool]:
    """The long run's figure as a ratio of the short run's, and whether both budgets hold."""
    ratio = long / short if short > 0 else float("inf")
    return ratio, long <= BUDGET_S and ratio <= BUDGET_RATIO


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--days", type=int, default=30)
    p.add_argument("--ranks", type=int, default=4096)
    args = p.parse_args(argv)
    short_days = 1
    with pg_database() as url:
        t0 = time.perf_counter()
        with psycopg.connect(url.replace("+psycopg", "")) as conn:
            runs = {}
            for days in dict.fromkeys((short_days, args.days)):
                name = f"bench-{days}d"
                run_id, steps = _generate(conn, name, days, args.ranks)
                _buckets(url, run_id)
                runs[days] = (name, steps)
            conn.execute("ANALYZE")
            rw_rows, rw_bytes, rw_tuple = conn.execute(
                "SELECT count(*), pg_total_relation_size('rank_windows'), avg(pg_column_size(w.*)) "
                "FROM rank_windows w"
            ).fetchone()  # type: ignore[misc]
            js_rows, js_bytes = conn.execute(
                "SELECT count(*), pg_total_relation_size('job_steps') FROM job_steps"
            ).fetchone()  # type: ignore[misc]
        gen_s = time.perf_counter() - t0
        with (
            server(
                ["stepwatch", "serve", "--database-url", url, "--log-level", "warning"], "/readyz"
            ) as base,
            httpx.Client(base_url=base, timeout=60) as c,
        ):
            asked = {days: _requests(name, steps) for days, (name, steps) in runs.items()}
            timings: dict[int, dict[str, float]] = {days: {} for days in runs}
            for what in asked[args.days]:
                figures = _paired(c, [asked[days][what] for days in runs], n=5 if "ranks" in what else 10)
                for days, t in zip(runs, figures, strict=True):
                    timings[days][what] = t
            (listing,) = _paired(c, [("/api/v1/runs", {})])
    per_row = rw_bytes / rw_rows
    windows_month = 30 * 86400 / STEP_S * args.ranks
    rolled_month = windows_month * (2 / 30) + windows_month * (28 / 30) / ROLLUP
    print(
        f"query: {short_days} and {args.days} days of a {args.ranks}-rank run at {STEP_S:.0f} s/step "
        f"({js_rows:,} job steps, {rw_rows:,} rank-window rows in all; generated in {gen_s:.0f} s)"
    )
    print(
        f"  budget: <= {BUDGET_S * 1e3:.0f} ms at {args.days} days and <= {BUDGET_RATIO:.0f}x "
        f"the {short_days}-day figure"
    )
    failed = False
    for what in timings[args.days]:
        short, long = timings[short_days][what], timings[args.days][what]
        ratio, met = verdict(short, long)
        failed |= not met
        print(
            f"  {what:42s} {short * 1e3:7.1f} ms at {short_days} d, {long * 1e3:7.1f} ms at {args.days} d: "
            f"ratio {ratio:4.2f}x  {'met' if met else 'MISSED'}"
        )
    print(f"  runs list {listing * 1e3:.1f} ms")
    print(
        f"  storage: rank window {per_row:.0f} B/row with its index ({rw_tuple:.0f} B tuple); "
        f"job step {js_bytes / js_rows:.0f} B/row"
    )
    print(
        f"  a month of {args.ranks} ranks: {windows_month * per_row / 1e9:.0f} GB of rank windows at full "
        f"resolution; {rolled_month * per_row / 1e9:.1f} GB with 2 days full + hourly rollup; "
        f"job steps {30 * 86400 / STEP_S * js_bytes / js_rows / 1e6:.0f} MB"
    )
    if failed:
        print("  (a missed budget is reported, not an error: the figures depend on the machine's load)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
