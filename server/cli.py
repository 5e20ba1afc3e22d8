"""Server side of the ``stepwatch`` command (imported lazily by ``stepwatch.cli``)."""

from __future__ import annotations

import logging
import sys

from .api.auth import Authenticator
from .settings import Settings
from .storage import migrate


def _settings(**overrides: object) -> Settings:
    values = {k: v for k, v in overrides.items() if v is not None}
    return Settings(**values)  # type: ignore[arg-type]


def db_upgrade(*, database_url: str | None, revision: str = "head") -> int:
    settings = _settings(database_url=database_url)
    migrate.upgrade(settings.database_url, revision)
    print(f"database at {migrate.current_revision_for_url(settings.database_url)}")
    return 0


def db_prune(
    *, database_url: str | None, full_days: float, factor: int, batch_id_days: float, trace_days: float = 7.0
) -> int:
    from .storage.backend import open_storage
    from .storage.engine import make_engine
    from .storage.retention import prune

    settings = _settings(database_url=database_url)
    engine = make_engine(settings.database_url)
    try:
        r = prune(
            open_storage(engine),
            full_days=full_days,
            factor=factor,
            batch_id_days=batch_id_days,
            trace_days=trace_days,
        )
    finally:
        engine.dispose()
    print(
        f"{r.runs} run(s): {r.windows_rolled_up} rank windows older than {full_days:g} days rolled up "
        f"into {r.rows_written} rows ({factor} windows each); {r.batch_ids_deleted} batch ids older "
        f"than {batch_id_days:g} days deleted; {r.traces_deleted} capture traces older than "
        f"{trace_days:g} days deleted"
    )
    return 0


def serve(
    *,
    host: str | None,
    port: int | None,
    database_url: str | None,
    log_level: str = "info",
    workers: int | None = None,
) -> int:
    settings = _settings(host=host, port=port, database_url=database_url, workers=workers)
    try:  # before the migrations: a bad token must not leave a migrated database and a traceback
        Authenticator.from_specs(settings.write_tokens, settings.read_tokens)
    except ValueError as e:
        print(f"stepwatch serve: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.migrate_on_start:
        migrate.upgrade(settings.database_url)
    from .exporter.registry import shared_counters
    from .worker.process import AnalysisProcess, analysis_apart

    with shared_counters():  # /metrics sums the web workers' and the analysis process's
        if not (settings.analysis_enabled and analysis_apart(settings)):
            run_uvicorn("stepwatch_server.app:app_from_env", settings, log_level=log_level)
            return 0
        analysis = AnalysisProcess(settings, log_level)
        analysis.start()
        try:  # the web workers without the analysis thread: it runs in its own process
            web = settings.model_copy(update={"analysis_enabled": False})
            run_uvicorn("stepwatch_server.app:app_from_env", web, log_level=log_level)
        finally:
            analysis.stop()
    return 0


def run_uvicorn(factory: str, settings: Settings, *, log_level: str = "info") -> None:
    """Serve ``factory`` (an import string of an app factory) the way production does:
    uvloop + httptools, ``settings.workers`` processes. The settings reach each worker
    through the environment, since workers import the factory afresh."""
    import os

    import uvicorn

    from .api.timeouts import uvicorn_options

    for name, value in settings.model_dump().items():
        if value is not None:
            os.environ[f"STEPWATCH_{name.upper()}"] = _env_value(value)
    uvicorn.run(
        factory,
        factory=True,
        host=settings.host,
        port=settings.port,
        workers=settings.workers,
        loop="uvloop",
        log_level=log_level,
        access_log=False,
        **uvicorn_options(settings),  # httptools with a read deadline, a connection cap
    )


def _env_value(value: object) -> str:
    import json

    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    return json.dumps(value)
