"""The collector's app factory. It owns its resources: the engine, the ingestor, the
metrics registry, the analysis worker and the webhook notifier are created here, the
threads started in the lifespan and stopped (before the engine is disposed) at shutdown,
never at import."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import Engine, text

import stepwatch

from . import errors, web
from .api import router
from .db.engine import make_engine
from .db.migrate import current_revision, head_revision
from .exporter import ExporterConfig, RunStateCollector
from .ingest import Ingestor
from .limits import BodyLimit
from .metrics import CollectorMetrics
from .settings import Settings
from .webhook import WebhookNotifier
from .worker import AnalysisWorker, WorkerConfig


def _worker_config(settings: Settings) -> WorkerConfig:
    return WorkerConfig(
        interval_s=settings.analysis_interval_s,
        grace_s=settings.analysis_grace_s,
        horizon_s=settings.analysis_horizon_s,
        hang_k=settings.hang_k,
        hang_floor_s=settings.hang_floor_s,
    )


def create_app(settings: Settings | None = None, *, engine: Engine | None = None) -> FastAPI:
    settings = settings or Settings()
    owns_engine = engine is None
    engine = engine or make_engine(settings.database_url)

    metrics = CollectorMetrics()
    notifier: WebhookNotifier | None = None
    if settings.webhook_url:
        notifier = WebhookNotifier(
            settings.webhook_url,
            fmt=settings.webhook_format,
            timeout_s=settings.webhook_timeout_s,
            max_attempts=settings.webhook_max_attempts,
            resend_s=settings.webhook_resend_s,
            public_url=settings.public_url,
            on_outcome=lambda outcome: metrics.webhook.labels(outcome).inc(),
        )
    worker = AnalysisWorker(
        engine,
        _worker_config(settings),
        notify=notifier.notify if notifier is not None else None,
        on_pass=metrics.record_pass,
    )

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

    app = FastAPI(
        title="stepwatch collector",
        version=stepwatch.__version__,
        description="Stores training-efficiency measurements from stepwatch agents and serves them.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.ingestor = Ingestor(engine, window_seconds=settings.window_seconds)
    app.state.metrics = metrics
    # Run, rank and flag series, read from the database at each scrape (bounded cardinality).
    metrics.registry.register(RunStateCollector(engine, ExporterConfig.from_settings(settings)))
    app.state.worker = worker
    app.state.notifier = notifier
    errors.install(app)
    app.include_router(router)
    web.install(app)  # the built-in web page at / and its /static files
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)

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
                headers={"Retry-After": str(errors.RETRY_AFTER_S)},
            )
        head = head_revision()
        if current != head:
            return JSONResponse(
                status_code=503,
                content={"status": "unavailable", "detail": f"schema at {current}, expected {head}"},
            )
        return JSONResponse({"status": "ready", "schema": current})

    @app.get("/metrics", tags=["ops"], summary="Prometheus exposition", response_class=Response)
    def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def app_from_env() -> FastAPI:
    """Factory for ``uvicorn --factory stepwatch_server.app:app_from_env``."""
    return create_app(Settings())
