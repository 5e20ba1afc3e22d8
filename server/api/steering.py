"""Steering routes: ask a run's ranks for a capture, change their live settings.

``POST /api/v1/runs/{run}/captures`` and ``PUT /api/v1/runs/{run}/config`` need an admin
token (``STEPWATCH_ADMIN_TOKENS``; open only while no token of any kind is configured),
the ``GET`` routes a read token. Directives reach the ranks in the answers to their next
batches (``steering/delivery.py``); nothing here talks to a training host.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Request, Response
from fastapi.exceptions import RequestValidationError
from sqlalchemy import Engine, select

from stepwatch import wire

from ..errors import ConflictError, NotFoundError
from ..reads import steering as reads
from ..reads.runs import RunInfo, get_run
from ..schemas.responses import CaptureOut, CaptureRequest, ConfigRequest, ConfigState, Problem
from ..settings import Settings
from ..steering import directives
from ..steering.delivery import Deliveries
from ..storage.models import Rank
from .auth import Credentials, authenticator
from .edge import RunPath

RANKS = Rank.__table__


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
            conn, info.id, plan, reason=_who(request), event_id=None, subject=subject, now=now
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
