"""The ``stepwatch`` command: ``serve``, ``db``, ``demo``, ``top``, ``capture``, ``config``, ``trace``,
``simulate``, ``evaluate``.

A training job installs the agent alone (``pip install stepwatch``); the other commands
need an extra (:data:`EXTRAS`) and import it only when they run. Without it a command
prints one line naming the extra and exits 2, and ``--help`` says which extra each
command is waiting for.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Sequence

from .config import DEFAULT_URL

#: extra -> (what it provides, the modules it must make importable).
EXTRAS: dict[str, tuple[str, tuple[str, ...]]] = {
    "server": (
        "the collector",
        (
            "fastapi",
            "uvicorn",
            "sqlalchemy",
            "alembic",
            "pydantic_settings",
            "prometheus_client",
            "numpy",
            "rich",
        ),
    ),
    "top": ("the terminal views", ("rich",)),
    "demo": (
        "the demo (a collector and a torch training)",
        ("torch", "fastapi", "uvicorn", "sqlalchemy", "rich"),
    ),
}
#: command -> the extra it needs (``simulate`` needs only the agent).
NEEDS = {
    "serve": "server",
    "db": "server",
    "evaluate": "server",
    "top": "top",
    "demo": "demo",
}


def missing_extra(command: str) -> str | None:
    """The extra ``command`` needs and is not installed, or ``None``."""
    extra = NEEDS.get(command)
    if extra is None:
        return None
    if all(importlib.util.find_spec(m) is not None for m in EXTRAS[extra][1]):
        return None
    return extra


def _help(command: str, text: str) -> str:
    extra = missing_extra(command)
    return text if extra is None else f"{text} [needs pip install 'stepwatch[{extra}]']"


def _serve(args: argparse.Namespace) -> int:
    from stepwatch_server.cli import serve

    return serve(
        host=args.host,
        port=args.port,
        database_url=args.database_url,
        log_level=args.log_level,
        workers=args.workers,
    )


def _db_upgrade(args: argparse.Namespace) -> int:
    from stepwatch_server.cli import db_upgrade

    return db_upgrade(database_url=args.database_url, revision=args.revision)


def _db_prune(args: argparse.Namespace) -> int:
    from stepwatch_server.cli import db_prune

    return db_prune(
        database_url=args.database_url,
        full_days=args.full_days,
        factor=args.factor,
        batch_id_days=args.batch_id_days,
        trace_days=args.trace_days,
    )


def _demo(args: argparse.Namespace) -> int:
    from .demo.runner import run_demo

    return run_demo(
        ranks=args.ranks,
        steps=args.steps,
        slow_rank=None if args.no_straggler else args.slow_rank,
        slow_ms=args.slow_ms,
        keep=args.keep,
        database=args.database,
        hold=args.hold,
    )


def _top(args: argparse.Namespace) -> int:
    from .views.top import run_top

    return run_top(
        args.url, run=args.run, interval_s=args.interval, iterations=args.iterations, token=args.token
    )


def _capture(args: argparse.Namespace) -> int:
    from .views.steer import capture

    return capture(
        args.url,
        args.run,
        token=args.token,
        rank=args.rank,
        host=args.host,
        everyone=args.all,
        steps=args.steps,
        wait_s=args.wait,
    )


def _config(args: argparse.Namespace) -> int:
    from .views.steer import configure

    settings = {
        k: v
        for k, v in (
            ("send_interval_s", args.send_interval),
            ("profile_every", args.profile_every),
            ("profile_steps", args.profile_steps),
        )
        if v is not None
    }
    return configure(args.url, args.run, settings, token=args.token, ranks=args.rank)


def _trace(args: argparse.Namespace) -> int:
    from .profiler.report import main as trace_report

    return trace_report(args.paths, as_json=args.json)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _evaluate(args: argparse.Namespace) -> int:
    from stepwatch_server.evaluation.cli import main as evaluate

    return evaluate(args)


def _url_and_token(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url",
        default=os.environ.get("STEPWATCH_URL", DEFAULT_URL),
        help=f"collector base URL (default: STEPWATCH_URL or {DEFAULT_URL})",
    )
    p.add_argument(
        "--token", default=os.environ.get("STEPWATCH_TOKEN"), help="admin token (or STEPWATCH_TOKEN)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stepwatch",
        description="Live training-efficiency monitor. New here? Run `stepwatch demo`.",
        epilog="`stepwatch COMMAND --help` describes each command.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser(
        "serve",
        help=_help("serve", "run the collector (applies database migrations first)"),
        description="Run the collector: REST API under /api/v1, the web page at /, Prometheus at /metrics.",
    )
    serve.add_argument("--host", default=None, help="bind address (default 127.0.0.1, or STEPWATCH_HOST)")
    serve.add_argument("--port", type=int, default=None, help="port (default 8321, or STEPWATCH_PORT)")
    serve.add_argument("--database-url", default=None, help="SQLAlchemy URL (or STEPWATCH_DATABASE_URL)")
    serve.add_argument(
        "--workers", type=int, default=None, help="worker processes (default 1, or STEPWATCH_WORKERS)"
    )
    serve.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    serve.set_defaults(func=_serve)

    db = sub.add_parser("db", help=_help("db", "database maintenance"), description="Database maintenance.")
    db_sub = db.add_subparsers(dest="db_command", required=True, metavar="DB_COMMAND")
    up = db_sub.add_parser(
        "upgrade",
        help="apply migrations up to a revision (default: head)",
        description="Apply the collector's database migrations up to REVISION (default: head).",
    )
    up.add_argument("revision", nargs="?", default="head")
    up.add_argument("--database-url", default=None, help="SQLAlchemy URL (or STEPWATCH_DATABASE_URL)")
    up.set_defaults(func=_db_upgrade)
    pr = db_sub.add_parser(
        "prune", help="retention: roll up old per-rank windows, forget old batch ids (run daily)"
    )
    pr.add_argument("--database-url", default=None, help="SQLAlchemy URL (or STEPWATCH_DATABASE_URL)")
    pr.add_argument(
        "--full-days", type=float, default=2.0, help="keep per-rank windows this long (default 2)"
    )
    pr.add_argument(
        "--factor", type=int, default=360, help="windows per rolled-up row (default 360: an hour of 10 s)"
    )
    pr.add_argument("--batch-id-days", type=float, default=7.0, help="forget batch ids after (default 7)")
    pr.add_argument(
        "--trace-days", type=float, default=7.0, help="delete captures' raw traces after (default 7)"
    )
    pr.set_defaults(func=_db_prune)

    demo = sub.add_parser(
        "demo",
        help=_help("demo", "collector + a real 4-rank CPU training with a straggler, watched live"),
        description="Start a collector on SQLite and a real multi-rank gloo training of a tiny GPT with "
        "the hook; slow one rank down mid-run and clear it later; show the run live from the API, "
        "then a short report. Every process it starts is stopped at the end or on Ctrl-C.",
    )
    demo.add_argument("--ranks", type=_positive_int, default=4, help="training processes (gloo, CPU)")
    demo.add_argument("--steps", type=_positive_int, default=120, help="optimizer steps per rank")
    demo.add_argument("--slow-rank", type=int, default=2, help="the rank slowed down mid-run")
    demo.add_argument("--slow-ms", type=float, default=120.0, help="extra compute per step of the slow rank")
    demo.add_argument("--no-straggler", action="store_true", help="train without the injected straggler")
    demo.add_argument("--keep", action="store_true", help="keep the demo database (./stepwatch-demo.db)")
    demo.add_argument("--database", default=None, help="SQLite file to use (kept afterwards)")
    demo.add_argument(
        "--hold",
        action="store_true",
        help="keep the collector and its web page up after training, until Ctrl-C",
    )
    demo.set_defaults(func=_demo)

    top = sub.add_parser(
        "top",
        help=_help("top", "live terminal view of the runs and ranks of a collector"),
        description="Live terminal view of a collector: its runs, and for one run the MFU, tokens/s, "
        "step-time trend, time breakdown, per-rank table and events. Ctrl-C quits.",
    )
    top.add_argument(
        "--url",
        default=os.environ.get("STEPWATCH_URL", DEFAULT_URL),
        help=f"collector base URL (default: STEPWATCH_URL or {DEFAULT_URL})",
    )
    top.add_argument("--run", default=None, help="run to show (default: the one seen most recently)")
    top.add_argument(
        "--token", default=os.environ.get("STEPWATCH_TOKEN"), help="read token (or STEPWATCH_TOKEN)"
    )
    top.add_argument("--interval", type=_positive_float, default=2.0, help="seconds between refreshes")
    top.add_argument("--iterations", type=_positive_int, default=None, help="stop after this many refreshes")
    top.set_defaults(func=_top)

    cap = sub.add_parser(
        "capture",
        help="profile the same steps on a rank and its peers, a host or the job, and explain",
        description="Ask a running job's ranks (through the collector) to run torch.profiler over the same "
        "steps, then print the explanation: per rank its breakdown and top ops, and how the subject rank "
        "differs from its peers. Needs an admin token when the collector has tokens.",
    )
    cap.add_argument("run", help="the run's name")
    who = cap.add_mutually_exclusive_group(required=True)
    who.add_argument("--rank", type=int, help="this rank and every rank it shares a communicator group with")
    who.add_argument("--host", help="the ranks of this host")
    who.add_argument("--all", action="store_true", help="the whole job (capped at 64 ranks)")
    cap.add_argument("--steps", type=_positive_int, default=None, help="steps to profile (1-16)")
    cap.add_argument(
        "--wait", type=float, default=120.0, help="seconds to wait for the explanation (0: do not wait)"
    )
    _url_and_token(cap)
    cap.set_defaults(func=_capture)

    cfg = sub.add_parser(
        "config",
        help="change a running job's live settings without a restart",
        description="Change the agents' send interval or profiler period and length through the collector; "
        "each rank applies it at its next window and says so (GET /api/v1/runs/RUN shows requested vs "
        "applied). Needs an admin token when the collector has tokens.",
    )
    cfg.add_argument("run", help="the run's name")
    cfg.add_argument("--send-interval", type=_positive_float, default=None, help="seconds between batches")
    cfg.add_argument(
        "--profile-every", type=int, default=None, help="steps between profiler windows (0: off)"
    )
    cfg.add_argument("--profile-steps", type=_positive_int, default=None, help="steps per profiler window")
    cfg.add_argument("--rank", type=int, action="append", default=None, help="only these ranks (repeatable)")
    _url_and_token(cfg)
    cfg.set_defaults(func=_config)

    tr = sub.add_parser(
        "trace",
        help="analyse torch.profiler traces you already have: breakdown, collectives, wait vs transfer",
        description="Analyse Kineto Chrome traces (one file per rank, .json or .json.gz; a directory "
        "stands for the traces in it) with the profiler window's own parser: per rank and step the "
        "time breakdown, per collective type count, bytes and duration, and, with several ranks, the "
        "collectives lined up across ranks into wait and transfer. A trace without ProfilerStep "
        "markers is one step.",
    )
    tr.add_argument("paths", nargs="+", metavar="FILE_OR_DIR", help="trace files or directories of them")
    tr.add_argument("--json", action="store_true", help="print JSON instead of tables")
    tr.set_defaults(func=_trace)

    from .simulate.cli import add_parser as add_simulate

    add_simulate(sub)

    ev = sub.add_parser(
        "evaluate",
        help=_help(
            "evaluate", "score the detectors on simulated faults and clean runs, through a real collector"
        ),
        description="Run every fault scenario and clean runs through the simulator, a real collector "
        "process and its analysis worker (and, at scale, straight into the detectors), then print per "
        "scenario whether the fault was flagged, with the right cause and rank, after how many "
        "windows, and the false flags on clean windows.",
    )
    ev.add_argument("--fast", action="store_true", help="small scenarios (seconds; used by the tests)")
    ev.add_argument("--database-url", default=None, help="collector database (default: a temporary SQLite)")
    ev.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    ev.add_argument("--seed", type=int, default=1)
    ev.add_argument(
        "--real",
        action="store_true",
        help="real-training scenarios instead: 4 gloo ranks, real faults, a CPU burner (minutes per run)",
    )
    ev.add_argument("--runs", type=int, default=1, help="with --real: runs per scenario")
    ev.add_argument(
        "--scenario", action="append", default=None, help="with --real: one scenario by name; repeatable"
    )
    ev.set_defaults(func=_evaluate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    extra = missing_extra(args.command)
    if extra is not None:
        print(
            f"`stepwatch {args.command}` needs {EXTRAS[extra][0]}: pip install 'stepwatch[{extra}]'",
            file=sys.stderr,
        )
        return 2
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
