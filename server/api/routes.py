"""REST API, versioned under ``/api/v1`` (DESIGN §2)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import pydantic_core
from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from sqlalchemy import Engine
from sqlalchemy.exc import DataError

from stepwatch import wire

from ..errors import CollectorError, ConflictError, ForbiddenError
from ..exporter.registry import CollectorMetrics
from ..ingest.admission import QuotaExceededError, may_write
from ..ingest.group_commit import GroupCommitter
from ..ingest.store import Ingestor, RunKey
from ..reads import queries, steering
from ..reads.runs import find_run
from ..reads.status import MEANING, STATUSES, StatusRule
from ..schemas.ingest import IngestBatches, IngestPayload, explained
from ..schemas.responses import (
    EventOut,
    IngestBatchesResult,
    IngestResult,
    Problem,
    RankSummary,
    RunOverview,
    RunSummary,
    Series,
)
from ..settings import Settings
from ..steering.delivery import Deliveries
from .auth import Credentials, authenticator
from .edge import RunPath, may_hold_nul, refuse_nul

log = logging.getLogger("stepwatch_server")
_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": Problem, "description": "A bearer token is required, or the one sent is unknown"},
    403: {"model": Problem, "description": "The token may not do this"},
    404: {"model": Problem, "description": "Unknown run or metric"},
    503: {"model": Problem, "description": "Database unavailable; retry after Retry-After seconds"},
}


async def _authorize(request: Request, credentials: Credentials) -> None:
    """Every route of the API: POST needs a write token, the rest a read token (when
    configured, ``api/auth.py``). The token's name is kept for quotas."""
    request.state.token = authenticator(request).check(
        credentials, "write" if request.method == "POST" else "read"
    )


PREFIX = "/api/v1"
#: The ingest routes' paths (also answered by ``ingest_path.IngestPath``, outside routing).
INGEST_PATH = wire.INGEST_PATH
HOST_BATCH_PATH = wire.HOST_BATCH_PATH
router = APIRouter(
    prefix=PREFIX,
    dependencies=[Depends(_authorize)],
    responses={
        401: _ERRORS[401],
        403: _ERRORS[403],
        422: {"model": Problem, "description": "Invalid request; the detail names each bad field"},
    },
)


def _engine(request: Request) -> Engine:
    engine: Engine = request.app.state.engine
    return engine


#: The ingest body's JSON schema, published under components (``app.py`` adds them).
INGEST_SCHEMAS: dict[str, Any] = IngestBatches.model_json_schema(ref_template="#/components/schemas/{model}")
INGEST_SCHEMAS = {**INGEST_SCHEMAS.pop("$defs", {}), "IngestBatches": INGEST_SCHEMAS}


@router.post(
    INGEST_PATH.removeprefix(PREFIX),
    response_model=IngestResult,
    responses={
        401: _ERRORS[401],
        403: {
            "model": Problem,
            "description": "Not a write token, its run quota is used up, or the run belongs to another token",
        },
        409: {
            "model": Problem,
            "description": "The batch's world size is not the run's: a restart at another size is a new run",
        },
        413: {"model": Problem, "description": "Body too large"},
        422: {"model": Problem, "description": "Invalid payload; nothing was stored"},
        503: _ERRORS[503],
    },
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/IngestPayload"}}},
        }
    },
    summary="Store one window of one rank (idempotent by batch_id)",
)
async def ingest(request: Request) -> IngestResult:
    # The body is parsed and validated in one pass by pydantic-core
    # (``model_validate_json``), three times cheaper than FastAPI's json.loads followed
    # by validation of the Python objects; errors still answer 422 naming each field.
    body = await request.body()
    try:
        payload = IngestPayload.model_validate_json(body)
    except ValidationError as exc:
        raise RequestValidationError(explained(exc.errors(include_url=False, include_input=False))) from None
    refuse_nul(body, payload)
    owner: str | None = request.state.token
    await _within_limits(request, payload, owner)
    return await _store(request, payload, owner)


@router.post(
    HOST_BATCH_PATH.removeprefix(PREFIX),
    response_model=IngestBatchesResult,
    responses={
        401: _ERRORS[401],
        403: {
            "model": Problem,
            "description": "Not a write token, a run quota is used up, or a run belongs to another token",
        },
        409: {"model": Problem, "description": "An entry's world size is not its run's"},
        413: {"model": Problem, "description": "Body too large"},
        422: {"model": Problem, "description": "An invalid entry (batches.<i>.<field>); nothing stored"},
        503: _ERRORS[503],
    },
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/IngestBatches"}}},
        }
    },
    summary="Store the windows of several ranks (one host) in one request, each idempotent by batch_id",
)
async def ingest_batches(request: Request) -> IngestBatchesResult:
    """Per-host batching: each entry is checked as ``ingest`` checks a payload alone (the
    same validation, limits and admission, its errors named ``batches.<i>.<field>``),
    all of them before any is stored, so a refused POST stores nothing. The entries then
    join the group commit together and the answer comes once every one is committed.
    The one exception to "nothing stored": an entry the database itself refuses (a
    ``DataError`` the schema should make impossible) is answered 422 at its index while
    its neighbours are stored; a retry then finds them stored and stores nothing twice."""
    body = await request.body()
    try:
        payloads = IngestBatches.model_validate_json(body).batches
    except ValidationError as exc:
        raise RequestValidationError(explained(exc.errors(include_url=False, include_input=False))) from None
    owner: str | None = request.state.token
    maybe_nul = may_hold_nul(body)  # one scan of the body; the entries are walked only if so
    settings: Settings = request.app.state.settings
    # Two passes: every check that needs no database first, so that an entry refused by
    # one of them creates no run for an entry before it; then admission, which creates
    # new runs (an entry refused there, over its token's quota or not its owner's,
    # leaves the runs of the entries before it created, as separate POSTs would).
    for check_all in (False, True):
        for i, payload in enumerate(payloads):
            try:
                if not check_all:
                    if maybe_nul:
                        refuse_nul(body, payload)
                    _settings_limits(settings, payload)
                else:
                    await _admitted(request, payload, owner)
            except RequestValidationError as exc:
                raise _entry_error(i, exc) from None
            except CollectorError as exc:
                raise type(exc)(f"batches.{i}: {exc}", headers=exc.headers) from None
    committer: GroupCommitter = request.app.state.group_commit
    t0 = time.perf_counter()
    outcomes = await committer.submit_many(payloads, owner)
    seconds = time.perf_counter() - t0
    committed = [(p, o) for p, o in zip(payloads, outcomes, strict=True) if not isinstance(o, Exception)]
    _count(request, committed, seconds)
    results = [await _answer(request, p, stored) for p, stored in committed]
    for i, (outcome, payload) in enumerate(zip(outcomes, payloads, strict=True)):
        if isinstance(outcome, DataError):
            raise _entry_error(i, _unstorable(request, payload, outcome))
        if isinstance(outcome, Exception):
            raise outcome
    return IngestBatchesResult(results=results)


def _entry_error(i: int, exc: RequestValidationError) -> RequestValidationError:
    """``exc`` about entry ``i`` of a host batch, each location prefixed ``batches.<i>``."""
    return RequestValidationError([{**e, "loc": ("batches", i, *e.get("loc", ()))} for e in exc.errors()])


async def _store(request: Request, payload: IngestPayload, owner: str | None) -> IngestResult:
    """Store one admitted, valid payload through the group commit; the result after its commit."""
    committer: GroupCommitter = request.app.state.group_commit
    t0 = time.perf_counter()
    try:
        stored = await committer.submit(payload, owner)
    except DataError as exc:
        raise _unstorable(request, payload, exc) from None
    _count(request, [(payload, stored)], time.perf_counter() - t0)
    return await _answer(request, payload, stored)


def _unstorable(request: Request, payload: IngestPayload, exc: DataError) -> RequestValidationError:
    """The 422 of a batch the database refused. The schema should make this impossible
    (every bound is a column's bound); if a value still slips through, the batch is
    refused (its neighbours in the group were stored one by one) rather than answered 500
    and retried for ever."""
    metrics: CollectorMetrics = request.app.state.metrics
    metrics.batches.labels("unstorable").inc()
    reason = str(exc.orig).strip().splitlines()[0] if exc.orig is not None else "value out of range"
    log.warning("batch %s of run %r refused by the database: %s", payload.batch_id, payload.run, reason)
    return _invalid(("body",), f"the database cannot store this batch: {reason}")


def _count(request: Request, committed: Sequence[tuple[IngestPayload, bool]], seconds: float) -> None:
    """Count one request's committed batches (each True if new, False if a duplicate),
    ``seconds`` from submission to commit: one increment per counter and request (in the
    multiprocess exporter each is a write to a shared file), the latency once per batch."""
    metrics: CollectorMetrics = request.app.state.metrics
    fresh = steps = 0
    for payload, stored in committed:
        metrics.ingest_seconds.observe(seconds)
        if stored:
            fresh += 1
            steps += len(payload.steps.time_s)
    if fresh:
        metrics.batches.labels("stored").inc(fresh)
        if steps:
            metrics.steps.inc(steps)
    if len(committed) > fresh:
        metrics.batches.labels("duplicate").inc(len(committed) - fresh)


async def _answer(request: Request, payload: IngestPayload, stored: bool) -> IngestResult:
    """A committed batch's answer, with its rank's directives."""
    return IngestResult(
        batch_id=payload.batch_id,
        stored=stored,
        steps=len(payload.steps.time_s),
        directives=await _directives(request, payload),
    )


async def _directives(request: Request, payload: IngestPayload) -> list[dict[str, Any]] | None:
    """This rank's directives (``steering/delivery.py``); never the batch's failure: it is
    committed, and the next answer carries what this one could not."""
    key = request.app.state.ingestor.cached(payload.run)
    if key is None:
        return None
    deliveries: Deliveries = request.app.state.deliveries
    try:
        return await deliveries.for_rank(key.id, payload.rank.rank, payload.agent.configs)
    except Exception:
        log.warning("could not read the directives of run %r", payload.run, exc_info=True)
        return None


async def _within_limits(request: Request, payload: IngestPayload, owner: str | None) -> None:
    """This collector's configurable limits (settings), beyond the schema's fixed bounds,
    then the run's admission (created if new), owner and world size."""
    _settings_limits(request.app.state.settings, payload)
    await _admitted(request, payload, owner)


def _settings_limits(settings: Settings, payload: IngestPayload) -> None:
    """The limits that need no database: steps per batch, ranks per run."""
    n = len(payload.steps.time_s)
    if n > settings.max_steps_per_batch:
        raise _invalid(
            ("steps", "time_s"),
            f"{n} steps in one batch; this collector accepts at most {settings.max_steps_per_batch} "
            "(STEPWATCH_MAX_STEPS_PER_BATCH)",
        )
    if payload.rank.world_size > settings.max_ranks_per_run:
        raise _invalid(
            ("rank", "world_size"),
            f"{payload.rank.world_size} ranks; this collector accepts at most {settings.max_ranks_per_run} "
            "per run (STEPWATCH_MAX_RANKS_PER_RUN)",
        )


async def _admitted(request: Request, payload: IngestPayload, owner: str | None) -> None:
    """The run's admission (created if new and the token has a run left), its owner and
    its world size."""
    settings: Settings = request.app.state.settings
    ingestor: Ingestor = request.app.state.ingestor
    key = ingestor.cached(payload.run)
    if key is None:  # not seen lately: admit it, creating it if new (rare, off-loop)
        try:
            key = await _admission(request, ingestor, payload, owner, settings.max_runs_per_token)
        except QuotaExceededError as exc:
            who = f"token {owner!r}" if owner else "anonymous writers"
            raise ForbiddenError(
                f"run {payload.run!r} refused: {who} created {exc.used} runs, the limit is "
                f"{settings.max_runs_per_token} (STEPWATCH_MAX_RUNS_PER_TOKEN)",
            ) from None
    if not may_write(key.owner, owner, request.app.state.shared_writers):
        raise ForbiddenError(
            f"run {payload.run!r} belongs to token {key.owner!r}; token {owner!r} may not write "
            "into it (STEPWATCH_SHARED_WRITE_TOKENS names tokens that may)",
        )
    if payload.rank.world_size != key.world_size:
        raise ConflictError(
            f"rank.world_size: run {payload.run!r} has {key.world_size} ranks, this batch "
            f"declares {payload.rank.world_size}: a restart at another size is a new run, "
            "send it under a new run name",
        )


async def _admission(
    request: Request, ingestor: Ingestor, payload: IngestPayload, owner: str | None, limit: int
) -> RunKey:
    """One admission per new run at a time: the first batches of a new run arrive from
    all its ranks at once, and one database transaction answers them all."""
    checks: dict[tuple[str, str | None], asyncio.Future[RunKey]] = request.app.state.run_checks
    key = (payload.run, owner)
    check = checks.get(key)
    if check is None:
        check = asyncio.ensure_future(asyncio.to_thread(ingestor.admit, payload, owner, limit))
        checks[key] = check
        check.add_done_callback(lambda _: checks.pop(key, None))
    return await asyncio.shield(check)


#: ``?status=``'s description: each status the runs show, from their one definition.
_STATUS_FILTER = (
    "the runs of one status, as each run's `status` shows it: "
    + "; ".join(f"`{s}` ({MEANING[s]})" for s in STATUSES)
    + "; or `running`: not finished (live, stalled or hung)"
)


def _invalid(loc: tuple[str, ...], msg: str) -> RequestValidationError:
    return RequestValidationError([{"loc": loc, "msg": msg, "type": "limit"}])


@router.get(
    "/runs",
    response_model=list[RunSummary],
    responses={
        200: {
            "headers": {
                "X-Total-Count": {"description": "Runs matching the filters", "schema": {"type": "integer"}},
                "Link": {
                    "description": 'The next page as `<url>; rel="next"`, if any',
                    "schema": {"type": "string"},
                },
            }
        },
        503: _ERRORS[503],
    },
    summary="Runs, newest first, one page at a time",
)
def list_runs(
    request: Request,
    response: Response,
    limit: Annotated[int, Query(ge=1, le=queries.RUNS_PAGE_MAX)] = queries.RUNS_PAGE,
    offset: Annotated[int, Query(ge=0, le=2**31)] = 0,
    status: Annotated[queries.ListStatus | None, Query(description=_STATUS_FILTER)] = None,
    prefix: Annotated[
        str | None, Query(pattern=r"^[A-Za-z0-9._:-]{1,128}$", description="name prefix")
    ] = None,
    since: Annotated[
        float | None, Query(ge=0, le=253_402_300_799, description="reported since (Unix s)")
    ] = None,
) -> list[RunSummary]:
    with _engine(request).connect() as conn:
        runs, total = queries.list_runs(
            conn,
            limit=limit,
            offset=offset,
            where=queries.RunFilter(status=status, prefix=prefix, since=since),
            rule=StatusRule.from_settings(request.app.state.settings),
        )
    response.headers["X-Total-Count"] = str(total)
    if offset + len(runs) < total:
        response.headers["Link"] = f'<{request.url.include_query_params(offset=offset + limit)}>; rel="next"'
    return runs


@router.get("/runs/{run}", response_model=RunOverview, responses=_ERRORS)
def run_overview(run: RunPath, request: Request) -> RunOverview:
    with _engine(request).connect() as conn:
        out = queries.overview(conn, run, rule=StatusRule.from_settings(request.app.state.settings))
        info = find_run(conn, run)
        if info is not None:
            out.config = steering.configs(conn, info.id)
        return out


@router.get("/runs/{run}/series", response_model=Series, responses=_ERRORS)
def run_series(
    run: RunPath,
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
    run: RunPath,
    request: Request,
    profile_windows: Annotated[
        int, Query(ge=1, le=64, description="newest profiled windows merged into the collective quantiles")
    ] = 1,
) -> Response:
    with _engine(request).connect() as conn:
        rows = queries.rank_rows(conn, run, profile_windows=profile_windows)
    # One rank per row of a large run (16,384 ranks): the rows are RankSummary's fields
    # already of its types, serialised in one pass by pydantic-core as the models would
    # be, not validated into models first (most of the request at 4,096 ranks).
    return Response(pydantic_core.to_json(rows), media_type="application/json")


@router.get("/runs/{run}/events", response_model=list[EventOut], responses=_ERRORS)
def run_events(
    run: RunPath,
    request: Request,
    status: Annotated[Literal["open", "closed"] | None, Query()] = None,
    kind: Annotated[Literal["straggler", "regression", "hang"] | None, Query()] = None,
) -> list[EventOut]:
    with _engine(request).connect() as conn:
        return queries.events(conn, run, status=status, kind=kind)
