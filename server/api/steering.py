"""Steering routes: ask a run's ranks for a capture, change their live settings.

``POST /api/v1/runs/{run}/captures`` and ``PUT /api/v1/runs/{run}/config`` need an admin
token (``STEPWATCH_ADMIN_TOKENS``; open only while no token of any kind is configured),
the ``GET`` routes a read token; a rank uploads a capture's raw trace with its write token
(``traces``: only a rank the capture asked, into a run its token may write). Directives
reach the ranks in the answers to their next batches (``steering/delivery.py``); nothing
here talks to a training host.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Annotated, Any, cast

from fastapi import APIRouter, Depends, Path, Request, Response
from fastapi.exceptions import RequestValidationError
from sqlalchemy import Engine, Table, select

from stepwatch import wire

from ..errors import ConflictError, ForbiddenError, NotFoundError
from ..ingest.admission import may_write
from ..reads import steering as reads
from ..reads.runs import RunInfo, get_run
from ..schemas.responses import CaptureOut, CaptureRequest, ConfigRequest, ConfigState, Problem
from ..settings import Settings
from ..steering import directives
from ..steering.delivery import Deliveries
from ..storage.backend import Storage
from ..storage.models import CaptureTrace, Directive, Rank, Run
from .auth import Credentials, authenticator
from .edge import RunPath

RANKS = Rank.__table__
RUNS = Run.__table__
CAPTURES = Directive.__table__
TRACES = cast(Table, CaptureTrace.__table__)


async def _authorize(request: Request, credentials: Credentials) -> None:
    """Reading needs a read (or admin) token, steering an admin token."""
    request.state.token = authenticator(request).check(
        credentials, "read" if request.method == "GET" else "admin"
    )


_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": Problem, "description": "The body is not JSON"},
    401: {"model": Problem, "description": "A bearer token is required, or the one sent is unknown"},
    403: {"model": Problem, "description": "Steering needs an admin token (STEPWATCH_ADMIN_TOKENS)"},
    404: {"model": Problem, "description": "Unknown run or capture"},
    409: {"model": Problem, "description": "Every rank of the run finished: no rank would take it"},
    422: {"model": Problem, "description": "Invalid request; the detail names the field"},
}
router = APIRouter(prefix="/api/v1", dependencies=[Depends(_authorize)], responses=_ERRORS, tags=["steering"])


def _engine(request: Request) -> Engine:
    engine: Engine = request.app.state.engine
    return engine


def _invalid(field: str, msg: str) -> RequestValidationError:
    return RequestValidationError([{"loc": ("body", field), "msg": msg, "type": "value_error"}])


def _who(request: Request) -> str:
    token: str | None = request.state.token
    return f"token {token}" if token else "open"


def _running(conn: Any, run: RunInfo) -> list[int]:
    """The ranks that reported and did not finish; 409 if none is left."""
    rows = conn.execute(
        select(RANKS.c.rank, RANKS.c.last_step, RANKS.c.final_step).where(RANKS.c.run_id == run.id)
    ).all()
    live = [r.rank for r in rows if r.final_step is None or r.last_step > r.final_step]
    if not live:
        raise ConflictError(
            f"run {run.name!r}: every rank finished (or none reported); no rank would take it"
        )
    return live


def _targets(
    conn: Any, run: RunInfo, body: CaptureRequest, live: list[int]
) -> tuple[list[int], list[int], list[str]]:
    """(ranks to capture, the subject ranks, notes) for a capture request."""
    given = sum(x is not None for x in (body.rank, body.ranks, body.host)) + body.all
    if given != 1:
        raise _invalid("rank", "give exactly one of rank, ranks, host or all")
    notes: list[str] = []
    if body.rank is not None:
        if body.rank not in live:
            raise _invalid("rank", f"rank {body.rank} is not a running rank of run {run.name!r}")
        subject, pool = [body.rank], directives.with_peers(conn, run.id, [body.rank])
    elif body.ranks is not None:
        unknown = sorted(set(body.ranks) - set(live))
        if unknown:
            raise _invalid("ranks", f"ranks {unknown[:8]} are not running ranks of run {run.name!r}")
        subject, pool = sorted(set(body.ranks)), sorted(set(body.ranks))
    elif body.host is not None:
        pool = [r for r in directives.host_ranks(conn, run.id, body.host) if r in live]
        if not pool:
            raise _invalid("host", f"host {body.host!r} has no running rank in run {run.name!r}")
        subject = []
    else:
        subject, pool = [], live
    pool = [r for r in pool if r in live]
    targets = directives.cap_ranks(pool, subject)
    if len(targets) < len(pool):
        notes.append(f"capped at {len(targets)} of {len(pool)} ranks (the nearest to the subject by number)")
    return targets, subject, notes


@router.post(
    "/runs/{run}/captures",
    response_model=CaptureOut,
    status_code=201,
    summary="Profile the same steps on a rank and its peers, a host, some ranks or the job",
)
def create_capture(run: RunPath, body: CaptureRequest, request: Request, response: Response) -> CaptureOut:
    settings: Settings = request.app.state.settings
    now = directives.utcnow()
    with _engine(request).begin() as conn:
        info = get_run(conn, run)
        live = _running(conn, info)
        targets, subject, notes = _targets(conn, info, body, live)
        plan = directives.plan_capture(
            conn,
            info.id,
            targets,
            steps=body.steps or settings.capture_steps,
            max_cost_s=settings.capture_max_cost_s,
            now=now,
        )
        plan = replace(plan, notes=[*plan.notes, *notes])
        ident = directives.create_capture(
            conn,
            info.id,
            plan,
            reason=_who(request),
            event_id=None,
            subject=subject,
            now=now,
            trace_max_bytes=settings.trace_max_bytes,
        )
        out = reads.captures(conn, info.id, info.name, ident=ident)[0]
    deliveries: Deliveries = request.app.state.deliveries
    deliveries.forget(info.id)
    response.headers["Location"] = f"/api/v1/runs/{run}/captures/{ident}"
    return out


@router.get(
    "/runs/{run}/captures", response_model=list[CaptureOut], summary="The run's captures, newest first"
)
def list_captures(run: RunPath, request: Request) -> list[CaptureOut]:
    with _engine(request).connect() as conn:
        info = get_run(conn, run)
        return reads.captures(conn, info.id, info.name)


@router.get(
    "/runs/{run}/captures/{capture}", response_model=CaptureOut, summary="One capture and its explanation"
)
def get_capture(run: RunPath, capture: Annotated[int, Path(ge=1, le=2**62)], request: Request) -> CaptureOut:
    with _engine(request).connect() as conn:
        info = get_run(conn, run)
        found = reads.captures(conn, info.id, info.name, ident=capture)
    if not found:
        raise NotFoundError(f"run {run!r} has no capture {capture}")
    return found[0]


@router.put(
    "/runs/{run}/config",
    response_model=ConfigState,
    status_code=202,
    summary="Change live settings (send interval, profiler period and length) without a restart",
)
def put_config(run: RunPath, body: ConfigRequest, request: Request) -> ConfigState:
    settings, reason = wire.check_live_settings(body.settings)
    if reason is not None:
        raise _invalid("settings", reason)
    now = directives.utcnow()
    with _engine(request).begin() as conn:
        info = get_run(conn, run)
        live = _running(conn, info)
        if body.ranks is not None:
            unknown = sorted(set(body.ranks) - set(live))
            if unknown:
                raise _invalid("ranks", f"ranks {unknown[:8]} are not running ranks of run {run!r}")
        ident = directives.create_config(
            conn,
            info.id,
            settings,
            sorted(set(body.ranks)) if body.ranks else None,
            reason=_who(request),
            now=now,
        )
        state = next(c for c in reads.configs(conn, info.id) if c.id == ident)
    deliveries: Deliveries = request.app.state.deliveries
    deliveries.forget(info.id)
    return state


@router.get(
    "/runs/{run}/config",
    response_model=list[ConfigState],
    summary="Live settings requested, and applied per rank",
)
def get_config(run: RunPath, request: Request) -> list[ConfigState]:
    with _engine(request).connect() as conn:
        info = get_run(conn, run)
        return reads.configs(conn, info.id)


async def _authorize_upload(request: Request, credentials: Credentials) -> None:
    """A rank uploads with its write token; reading a trace back needs a read token."""
    request.state.token = authenticator(request).check(
        credentials, "read" if request.method == "GET" else "write"
    )


traces = APIRouter(
    prefix="/api/v1", dependencies=[Depends(_authorize_upload)], responses=_ERRORS, tags=["steering"]
)
TRACE_PATH = wire.CAPTURE_TRACE_PATH.removeprefix("/api/v1")
GZIP_MAGIC = b"\x1f\x8b"


def _capture_row(conn: Any, run: RunInfo, capture: int) -> Any:
    row = conn.execute(
        select(CAPTURES.c.id, CAPTURES.c.params).where(
            CAPTURES.c.id == capture, CAPTURES.c.run_id == run.id, CAPTURES.c.kind == "capture"
        )
    ).first()
    if row is None:
        raise NotFoundError(f"run {run.name!r} has no capture {capture}")
    return row


@traces.put(
    TRACE_PATH,
    status_code=204,
    response_class=Response,
    summary="A capture's raw trace from a rank it asked for one (gzipped Chrome JSON; a write token)",
    openapi_extra={
        "requestBody": {
            "required": True,
            "description": "The gzipped Chrome trace (the agent sends Content-Type: application/gzip)",
            "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
        }
    },
)
async def put_trace(
    run: RunPath,
    capture: Annotated[int, Path(ge=1, le=2**62)],
    rank: Annotated[int, Path(ge=0, le=2**31 - 1)],
    request: Request,
) -> Response:
    settings: Settings = request.app.state.settings
    body = await request.body()
    if not body.startswith(GZIP_MAGIC):
        raise _invalid("body", "the trace must be gzipped (Content-Type: application/gzip)")
    cap = settings.trace_max_bytes
    if len(body) > cap:
        raise _invalid(
            "body",
            f"{len(body)} bytes; this collector keeps traces of at most {cap} (STEPWATCH_CAPTURE_MAX_BYTES)",
        )

    def store() -> None:
        with _engine(request).begin() as conn:
            info = get_run(conn, run)
            owner = conn.execute(select(RUNS.c.created_by).where(RUNS.c.id == info.id)).scalar()
            if not may_write(owner, request.state.token, request.app.state.shared_writers):
                raise ForbiddenError(f"run {run!r} belongs to token {owner!r}")
            row = _capture_row(conn, info, capture)
            if rank not in (row.params.get("trace_ranks") or []):
                raise ForbiddenError(f"capture {capture} did not ask rank {rank} for its trace")
            storage: Storage = request.app.state.ingestor.storage
            values = {"data": body, "size": len(body), "created_at": directives.utcnow()}
            conn.execute(
                storage.insert(TRACES)
                .values(directive_id=capture, rank=rank, **values)
                .on_conflict_do_update(index_elements=["directive_id", "rank"], set_=values)
            )

    await asyncio.to_thread(store)
    return Response(status_code=204)


@traces.get(
    TRACE_PATH,
    response_class=Response,
    responses={200: {"content": {"application/gzip": {}}, "description": "The trace, gzipped Chrome JSON"}},
    summary="Download a capture's raw trace (open it in Perfetto or chrome://tracing)",
)
def get_trace(
    run: RunPath,
    capture: Annotated[int, Path(ge=1, le=2**62)],
    rank: Annotated[int, Path(ge=0, le=2**31 - 1)],
    request: Request,
) -> Response:
    with _engine(request).connect() as conn:
        info = get_run(conn, run)
        _capture_row(conn, info, capture)
        data = conn.execute(
            select(TRACES.c.data).where(TRACES.c.directive_id == capture, TRACES.c.rank == rank)
        ).scalar()
    if data is None:
        raise NotFoundError(f"capture {capture} of run {run!r} has no trace of rank {rank}")
    name = f"{run}-capture{capture}-rank{rank}.json.gz"
    return Response(
        bytes(data),
        media_type="application/gzip",
        headers={"content-disposition": f'attachment; filename="{name}"'},
    )
