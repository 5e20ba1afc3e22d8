"""The ``stepwatch`` command: ``serve``, ``db upgrade``, ``demo``, ``simulate``, ``evaluate``.

Server commands import the collector lazily so that the agent alone (``pip install
stepwatch``) never needs FastAPI or SQLAlchemy.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _serve(args: argparse.Namespace) -> int:
    from stepwatch_server.cli import serve

    return serve(host=args.host, port=args.port, database_url=args.database_url, log_level=args.log_level)


def _db_upgrade(args: argparse.Namespace) -> int:
    from stepwatch_server.cli import db_upgrade

    return db_upgrade(database_url=args.database_url, revision=args.revision)


def _demo(args: argparse.Namespace) -> int:
    from .demo.runner import run_demo

    return run_demo(ranks=args.ranks, steps=args.steps, keep=args.keep)


def _evaluate(args: argparse.Namespace) -> int:
    from stepwatch_server.evaluation.cli import main as evaluate

    return evaluate(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stepwatch", description="Live training-efficiency monitor.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the collector (applies database migrations first)")
    serve.add_argument("--host", default=None, help="bind address (default 127.0.0.1, or STEPWATCH_HOST)")
    serve.add_argument("--port", type=int, default=None, help="port (default 8321, or STEPWATCH_PORT)")
    serve.add_argument("--database-url", default=None, help="SQLAlchemy URL (or STEPWATCH_DATABASE_URL)")
    serve.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    serve.set_defaults(func=_serve)

    db = sub.add_parser("db", help="database maintenance")
    db_sub = db.add_subparsers(dest="db_command", required=True, metavar="DB_COMMAND")
    up = db_sub.add_parser("upgrade", help="apply migrations up to a revision (default: head)")
    up.add_argument("revision", nargs="?", default="head")
    up.add_argument("--database-url", default=None, help="SQLAlchemy URL (or STEPWATCH_DATABASE_URL)")
    up.set_defaults(func=_db_upgrade)

    demo = sub.add_parser("demo", help="collector + a real 4-rank CPU training with the hook, then a summary")
    demo.add_argument("--ranks", type=int, default=4, help="training processes (gloo, CPU)")
    demo.add_argument("--steps", type=int, default=60, help="optimizer steps per rank")
    demo.add_argument("--keep", action="store_true", help="keep the demo database afterwards")
    demo.set_defaults(func=_demo)

    from .simulate.cli import add_parser as add_simulate

    add_simulate(sub)

    ev = sub.add_parser(
        "evaluate",
        help="score the detectors on simulated faults and clean runs, through a real collector",
        description="Run every fault scenario and clean runs through the simulator, a real collector "
        "process and its analysis worker (and, at scale, straight into the detectors), then print per "
        "scenario whether the fault was flagged, with the right cause and rank, after how many "
        "windows, and the false flags on clean windows.",
    )
    ev.add_argument("--fast", action="store_true", help="small scenarios (seconds; used by the tests)")
    ev.add_argument("--database-url", default=None, help="collector database (default: a temporary SQLite)")
    ev.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    ev.add_argument("--seed", type=int, default=1)
    ev.set_defaults(func=_evaluate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
