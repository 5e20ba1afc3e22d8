"""The collector's app factory. It owns its resources: the engine, the ingestor and the
metrics registry are created here and disposed of at shutdown, never at import."""

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


def create_app(settings: Settings | None = None, *, engine: Engine | None = None) -> FastAPI:
    settings = settings or Settings()
    owns_engine = engine is None
    engine = engine or make_engine(settings.database_url)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
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
    app.state.metrics = metrics = CollectorMetrics()
    # Run, rank and flag series, read from the database at each scrape (bounded cardinality).
    metrics.registry.register(RunStateCollector(engine, ExporterConfig.from_settings(settings)))
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
