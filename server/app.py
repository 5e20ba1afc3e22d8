"""The collector's app factory. It owns its resources: the engine, the ingestor, the
metrics registry, the analysis worker and the webhook notifier are created here, the
threads started in the lifespan and stopped (before the engine is disposed) at shutdown,
never at import."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import Engine, text
from starlette.types import Receive, Scope, Send

import stepwatch

from . import web
from .api import errors
from .api.auth import Authenticator, require_read
from .api.ingest_path import IngestPath, is_ingest
from .api.limits import BodyLimit
from .api.routes import INGEST_SCHEMAS, router
from .api.steering import router as steering_router
from .api.steering import traces as trace_router
from .exporter import ExporterConfig, RunStateCollector
from .exporter.registry import CollectorMetrics
from .ingest.group_commit import GroupCommitter
from .ingest.store import Ingestor
from .settings import Settings
from .steering.delivery import Deliveries
from .storage.backend import open_storage
from .storage.engine import make_engine
from .storage.migrate import current_revision, head_revision
from .worker.process import build_analysis


class CollectorApp(FastAPI):
    """The collector's FastAPI app, with its ingest route answered before the middleware
    chain and routing (``api/ingest_path.py``); every other request goes through them."""

    ingest_path: IngestPath | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.ingest_path is not None and is_ingest(scope):
            await self.ingest_path(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def create_app(settings: Settings | None = None, *, engine: Engine | None = None) -> FastAPI:
    settings = settings or Settings()
    owns_engine = engine is None
    engine = engine or make_engine(settings.database_url)
    storage = open_storage(engine)  # the one place the backend is chosen

    metrics = CollectorMetrics()
    worker, notifier = build_analysis(settings, storage, metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if notifier is not None:
            notifier.start()
        if settings.analysis_enabled:
            worker.start()
        try:
            yield
        finally:
            worker.stop()
            if notifier is not None:
                notifier.close()
            if owns_engine:
                engine.dispose()

    app = CollectorApp(
        title="stepwatch collector",
        version=stepwatch.__version__,
        description="Stores training-efficiency measurements from stepwatch agents and serves them.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.auth = Authenticator.from_specs(
        settings.write_tokens, settings.read_tokens, settings.admin_tokens
    )
    app.state.deliveries = Deliveries(engine)
    app.state.engine = engine
    app.state.ingestor = ingestor = Ingestor(
        storage, window_seconds=settings.window_seconds, window_steps=settings.window_steps
    )
    app.state.metrics = metrics
    app.state.run_checks = {}  # admissions of new runs in flight (api._admission)
    app.state.shared_writers = frozenset(
        t.strip() for t in settings.shared_write_tokens.split(",") if t.strip()
    )
    app.state.group_commit = GroupCommitter(ingestor.store_many, on_group=metrics.group_batches.observe)
    # Run, rank and flag series, read from the database at each scrape (bounded cardinality).
    exposed = metrics.exposition(RunStateCollector(engine, ExporterConfig.from_settings(settings)))
    app.state.worker = worker
    app.state.notifier = notifier
    errors.install(app, retry_after_s=settings.retry_after_s)
    app.include_router(router)
    app.include_router(steering_router)
    app.include_router(trace_router)
    _publish_schemas(app, INGEST_SCHEMAS)
    # The built-in web page at / and its /static files; its pages read runs like the API.
    web.install(app, dependencies=[Depends(require_read)])
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.ingest_path = IngestPath(app, max_bytes=settings.max_body_bytes)
    origins = [o.strip() for o in settings.cors_origins.split(",") if o.strip()]
    if origins:  # off unless configured: the API is for agents, Grafana and scripts
        app.add_middleware(
            CORSMiddleware,
            allow_origins=origins,
            allow_methods=["GET"],
            allow_headers=["authorization"],
        )

    @app.get("/healthz", tags=["ops"], summary="The process is up")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["ops"], summary="Database reachable and schema at head", response_model=None)
    def readyz(request: Request) -> Response:
        try:
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))
            current = current_revision(engine)
        except Exception as exc:
            return JSONResponse(
                status_code=503,
                content={"status": "unavailable", "detail": f"database: {exc.__class__.__name__}"},
                headers={"Retry-After": str(settings.retry_after_s)},
            )
        head = head_revision()
        if current != head:
            return JSONResponse(
                status_code=503,
                content={"status": "unavailable", "detail": f"schema at {current}, expected {head}"},
            )
        return JSONResponse({"status": "ready", "schema": current})

    metrics_auth = [Depends(require_read)] if settings.metrics_require_token else []

    @app.get(
        "/metrics",
        tags=["ops"],
        summary="Prometheus exposition",
        response_class=Response,
        dependencies=metrics_auth,
    )
    def prometheus_metrics() -> Response:
        return Response(generate_latest(exposed), media_type=CONTENT_TYPE_LATEST)

    return app


def _publish_schemas(app: FastAPI, schemas: dict[str, Any]) -> None:
    """Add schemas that routes reference by hand (a body parsed by the route itself)
    to the generated OpenAPI document's components."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = generate()
            doc.setdefault("components", {}).setdefault("schemas", {}).update(schemas)
        return app.openapi_schema or {}

    app.openapi = openapi  # type: ignore[method-assign]


def app_from_env() -> FastAPI:
    """Factory for ``uvicorn --factory stepwatch_server.app:app_from_env`` (what ``stepwatch
    serve`` runs in each worker process)."""
    app = create_app(Settings())
    tune_gc()
    return app


def tune_gc() -> None:
    """Process-wide GC tuning for a collector process (never applied by ``create_app``).

    A group of thousands of validated batches is a lot of short-lived containers: with
    the default thresholds the cyclic collector ran every few requests and took about a
    sixth of the worker's time. Objects that live as long as the process (modules, the
    app) are frozen out of collection, and young collections run less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 50, 100)
