"""REST API, versioned under ``/api/v1`` (DESIGN §2)."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from sqlalchemy import Engine

from . import queries
from .ingest import Ingestor
from .metrics import CollectorMetrics
from .schemas import (
    EventOut,
    IngestPayload,
    IngestResult,
    Problem,
    RankSummary,
    RunOverview,
    RunSummary,
    Series,
)

router = APIRouter(prefix="/api/v1")
_ERRORS: dict[int | str, dict[str, Any]] = {
    404: {"model": Problem, "description": "Unknown run or metric"},
    503: {"model": Problem, "description": "Database unavailable; retry after Retry-After seconds"},
}


def _engine(request: Request) -> Engine:
    engine: Engine = request.app.state.engine
    return engine


@router.post(
    "/ingest",
    response_model=IngestResult,
    responses={
        413: {"model": Problem, "description": "Body too large"},
        422: {"model": Problem, "description": "Invalid payload; nothing was stored"},
        503: _ERRORS[503],
    },
    summary="Store one window of one rank (idempotent by batch_id)",
)
def ingest(payload: IngestPayload, request: Request) -> IngestResult:
    ingestor: Ingestor = request.app.state.ingestor
    metrics: CollectorMetrics = request.app.state.metrics
    t0 = time.perf_counter()
    stored = ingestor.store(payload)
    metrics.ingest_seconds.observe(time.perf_counter() - t0)
    metrics.batches.labels("stored" if stored else "duplicate").inc()
    n = len(payload.steps.time_s)
    if stored:
        metrics.steps.inc(n)
    return IngestResult(batch_id=payload.batch_id, stored=stored, steps=n)


@router.get("/runs", response_model=list[RunSummary], responses={503: _ERRORS[503]})
def list_runs(request: Request) -> list[RunSummary]:
    with _engine(request).connect() as conn:
        return queries.list_runs(conn)


@router.get("/runs/{run}", response_model=RunOverview, responses=_ERRORS)
def run_overview(run: str, request: Request) -> RunOverview:
    with _engine(request).connect() as conn:
        return queries.overview(conn, run)


@router.get("/runs/{run}/series", response_model=Series, responses=_ERRORS)
def run_series(
    run: str,
    request: Request,
    metric: Annotated[str, Query(description=f"one of {', '.join(queries.SERIES_METRICS)}")] = "step_time_s",
    from_step: Annotated[int | None, Query(ge=0)] = None,
    to_step: Annotated[int | None, Query(ge=0)] = None,
    max_points: Annotated[int, Query(ge=1, le=10_000)] = 500,
) -> Series:
    with _engine(request).connect() as conn:
        return queries.series(conn, run, metric, from_step=from_step, to_step=to_step, max_points=max_points)


@router.get("/runs/{run}/ranks", response_model=list[RankSummary], responses=_ERRORS)
def run_ranks(
    run: str,
    request: Request,
    profile_windows: Annotated[
        int, Query(ge=1, le=64, description="newest profiled windows merged into the collective quantiles")
    ] = 1,
) -> list[RankSummary]:
    with _engine(request).connect() as conn:
        return queries.ranks(conn, run, profile_windows=profile_windows)


@router.get("/runs/{run}/events", response_model=list[EventOut], responses=_ERRORS)
def run_events(
    run: str,
    request: Request,
    status: Annotated[Literal["open", "closed"] | None, Query()] = None,
    kind: Annotated[Literal["straggler", "regression", "hang"] | None, Query()] = None,
) -> list[EventOut]:
    with _engine(request).connect() as conn:
        return queries.events(conn, run, status=status, kind=kind)
