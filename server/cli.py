"""Server side of the ``stepwatch`` command (imported lazily by ``stepwatch.cli``)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import sys
import time
from typing import TYPE_CHECKING

from .api.auth import Authenticator
from .settings import Settings
from .storage import migrate

if TYPE_CHECKING:
    from .api.workers import Beat


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
    from .worker.process import analysis_apart

    apart = settings.analysis_enabled and analysis_apart(settings)
    try:
        _serve(settings, log_level, apart)
    except _TerminatedError:  # stopped: now die of the signal, as a SIGTERMed process does
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
    return 0


class _TerminatedError(Exception):
    """SIGTERM, raised where ``serve`` was so that its cleanup runs (uvicorn serving in this
    process shuts down gracefully, restores this handler and raises the signal again)."""


def _on_sigterm(*_: object) -> None:
    raise _TerminatedError


def _serve(settings: Settings, log_level: str, apart: bool) -> None:
    """The web workers and, ``apart``, the analysis process beside them; with more than one
    process, counters in prometheus_client's multiprocess mode, summed by every scrape."""
    from .exporter.registry import shared_counters
    from .worker.process import AnalysisProcess

    signal.signal(signal.SIGTERM, _on_sigterm)
    factory = "stepwatch_server.app:app_from_env"
    with shared_counters() if apart or settings.workers > 1 else contextlib.nullcontext():
        if not apart:
            run_uvicorn(factory, settings, log_level=log_level)
            return
        analysis = AnalysisProcess(settings, log_level)
        analysis.start()
        try:  # the web workers without the analysis thread: it runs in its own process
            web = settings.model_copy(update={"analysis_enabled": False})
            run_uvicorn(factory, web, log_level=log_level)
        finally:
            analysis.stop()


def run_uvicorn(factory: str, settings: Settings, *, log_level: str = "info") -> None:
    """Serve ``factory`` (an import string of an app factory) the way production does:
    uvloop + httptools, ``settings.workers`` processes (on Linux each with its own
    listening socket, ``api/workers.py``). The settings reach each worker through the
    environment, since workers import the factory afresh."""
    import uvicorn

    from .api import workers
    from .api.timeouts import uvicorn_options

    for name, value in settings.model_dump().items():
        if value is not None:
            os.environ[f"STEPWATCH_{name.upper()}"] = _env_value(value)
    if settings.workers > 1 and workers.balanced():
        worker = functools.partial(_web_worker, factory, log_level, os.getpid())
        stopped_by = workers.serve(
            settings.workers, settings.host, settings.port, worker, timeout_s=settings.worker_timeout_s
        )
        if stopped_by == signal.SIGTERM:
            signal.raise_signal(signal.SIGTERM)  # as uvicorn serving in this process does
        return
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


def _web_worker(factory: str, log_level: str, parent: int, host: str, port: int, beat: Beat) -> None:
    """One web worker (``api/workers.py``): uvicorn as ``run_uvicorn`` configures it, on
    a socket of its own bound to the collector's port; its settings from the environment.
    Named ``sw-web``, and stopped with ``serve`` even if ``serve`` is killed. Its event
    loop stamps ``beat`` at each of uvicorn's ticks (every 0.1 s once it serves): the
    supervisor kills a worker whose stamp is older than ``worker_timeout_s``."""
    import uvicorn

    class BeatingServer(uvicorn.Server):
        async def on_tick(self, counter: int) -> bool:
            beat.value = time.monotonic()
            return bool(await super().on_tick(counter))

    from .api import workers
    from .api.timeouts import uvicorn_options
    from .children import as_child_of

    as_child_of(parent, "sw-web")
    sock = workers.listening_socket(host, port)
    config = uvicorn.Config(
        factory,
        factory=True,
        host=host,
        port=port,
        loop="uvloop",
        log_level=log_level,
        access_log=False,
        **uvicorn_options(Settings()),
    )
    server = BeatingServer(config)
    with contextlib.suppress(KeyboardInterrupt):  # a SIGINT of its own: stopped, quietly
        server.run(sockets=[sock])
    if not server.started:  # its app failed to start, or it was stopped first: older
        sys.exit(3)  # uvicorn returns then, where uvicorn.run and newer ones exit 3


def _env_value(value: object) -> str:
    import json

    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    return json.dumps(value)
