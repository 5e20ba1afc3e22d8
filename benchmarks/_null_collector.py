"""The do-nothing baseline of the ingest benchmark: the collector's own app, web stack
and payload validation, served exactly as ``stepwatch serve`` serves it, with storage
replaced by a no-op. The ratio real/null is the share of the web stack's rate that the
database path keeps."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from fastapi import FastAPI

from stepwatch_server.app import create_app, tune_gc
from stepwatch_server.cli import run_uvicorn
from stepwatch_server.ingest.group_commit import Outcome
from stepwatch_server.ingest.store import RunKey
from stepwatch_server.schemas.ingest import IngestPayload
from stepwatch_server.settings import Settings


class NullCommitter:
    """The group commit's two entries (a lone batch, a host batch's), storing nothing."""

    async def submit(self, payload: IngestPayload, owner: str | None = None) -> bool:
        return True

    async def submit_many(self, payloads: Sequence[IngestPayload], owner: str | None = None) -> list[Outcome]:
        return [True] * len(payloads)


class NullDeliveries:
    """No directives: the real collector reads a run's once a second from the database,
    which the no-op collector has none of (every read failed, and logged its traceback)."""

    async def for_rank(self, run_id: int, rank: int, configs: Sequence[str] | None) -> None:
        return None


class NullIngestor:
    """Admits every run and caches its key, as the real collector's run cache does after a
    run's first batch."""

    def __init__(self) -> None:
        self._runs: dict[str, RunKey] = {}

    def cached(self, name: str) -> RunKey | None:
        return self._runs.get(name)

    def admit(self, p: IngestPayload, owner: str | None, limit: int) -> RunKey:
        key = RunKey(
            id=0, window_steps=1, dp_size=p.rank.layout.dp, world_size=p.rank.world_size, owner=owner
        )
        return self._runs.setdefault(p.run, key)


def app_factory() -> FastAPI:
    app = create_app(Settings())
    app.state.group_commit = NullCommitter()
    app.state.ingestor = NullIngestor()
    app.state.deliveries = NullDeliveries()
    tune_gc()  # as app_from_env does for the real collector
    return app


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--workers", type=int, default=1)
    args = p.parse_args(argv)
    settings = Settings(
        database_url="sqlite://", port=args.port, workers=args.workers, migrate_on_start=False
    )
    run_uvicorn("benchmarks._null_collector:app_factory", settings, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
