"""Pages: ``/`` lists the runs, ``/runs/{run}`` shows one run. Not part of the API
(hidden from the OpenAPI document); the JSON lives under ``/api/v1``."""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates
from sqlalchemy import Engine

import stepwatch
from stepwatch.views.terminal import duration

from ..api.edge import RunPath
from ..errors import NotFoundError
from ..reads import queries
from ..reads.status import MEANING, StatusRule
from . import data

router = APIRouter(include_in_schema=False)
templates = Jinja2Templates(directory=Path(__file__).parent / "templates")


def _ago(ts: float | datetime | None) -> str:
    if not ts:
        return "never"
    s = max(0.0, time.time() - (ts.timestamp() if isinstance(ts, datetime) else ts))
    if s < 90:
        return f"{s:.0f} s ago"
    if s < 5400:
        return f"{s / 60:.0f} min ago"
    if s < 172_800:
        return f"{s / 3600:.1f} h ago"
    return f"{s / 86_400:.1f} days ago"


def _num(v: Any, spec: str = ".3g") -> str:
    return "–" if v is None else format(v, spec)


def _pct(v: Any, digits: int = 2) -> str:
    return "–" if v is None else f"{100 * v:.{digits}f}%"


def _date(ts: float | None) -> str:
    return "–" if ts is None else time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))


templates.env.filters.update(ago=_ago, num=_num, pct=_pct, duration=duration, date=_date)
templates.env.globals["version"] = stepwatch.__version__
templates.env.globals["status_help"] = MEANING


def _engine(request: Request) -> Engine:
    engine: Engine = request.app.state.engine
    return engine


def _rule(request: Request) -> StatusRule:
    return StatusRule.from_settings(request.app.state.settings)


@router.get("/", response_class=HTMLResponse)
def runs_page(request: Request, offset: Annotated[int, Query(ge=0, le=2**31)] = 0) -> HTMLResponse:
    with _engine(request).connect() as conn:
        runs, total = data.runs(conn, offset=offset, rule=_rule(request))
    page = queries.RUNS_PAGE
    context = {
        "runs": runs,
        "total": total,
        "offset": offset,
        "prev": max(0, offset - page) if offset else None,
        "next": offset + page if offset + len(runs) < total else None,
    }
    return templates.TemplateResponse(request, "runs.html", context)


@router.get("/runs/{run}", response_class=HTMLResponse)
def run_page(
    request: Request,
    run: RunPath,
    heat: Annotated[str | None, Query(description="heatmap metric")] = None,
) -> HTMLResponse:
    with _engine(request).connect() as conn:
        try:
            page = data.run_page(conn, run, heat=heat, rule=_rule(request))
        except NotFoundError:
            runs, total = data.runs(conn, rule=_rule(request))
            return templates.TemplateResponse(
                request, "missing.html", {"run": run, "runs": runs, "total": total}, status_code=404
            )
    chart_data = {
        "charts": page["charts"],
        "events": [
            {
                "kind": e["kind"],
                "first_step": e["first_step"],
                "last_step": e["last_step"],
                "status": e["status"],
            }
            for e in page["events"]
        ],
    }
    page["chart_json"] = json.dumps(chart_data, allow_nan=False, separators=(",", ":"))
    page["heat_metrics"] = {k: label for k, (label, _) in data.HEAT_METRICS.items()}
    return templates.TemplateResponse(request, "run.html", page)
