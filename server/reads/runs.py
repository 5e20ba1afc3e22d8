"""A stored run as every reader sees it: the API, the web page, the analysis worker and
``/metrics``.

One row -> value mapping (:func:`run_info`), so a column added to ``runs`` is read in
one place.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, select

from stepwatch.flops import per_token_rate

from ..errors import NotFoundError
from ..storage.models import Run, unix

RUNS = Run.__table__


@dataclass(frozen=True, slots=True)
class RunInfo:
    id: int
    name: str
    world_size: int
    dp_size: int
    layout: Mapping[str, int]
    convention: Mapping[str, Any] | None
    window_steps: int
    config_fingerprint: str | None
    baseline_run: str | None
    #: Collector-clock time of the run's newest stored batch (Unix s; None: never stamped).
    last_report_ts: float | None = None
    #: ``window_steps`` is a placeholder until a batch shows the run's pace.
    window_provisional: bool = False

    @property
    def mfu_per_token_rate(self) -> float | None:
        """MFU per token/s: flops_per_token / (devices x peak); None when the peak is unknown."""
        return per_token_rate(self.convention, self.world_size)


def run_info(row: Any) -> RunInfo:
    """A ``runs`` row (all columns) as a :class:`RunInfo`."""
    return RunInfo(
        id=row.id,
        name=row.name,
        world_size=row.world_size,
        dp_size=row.dp_size,
        layout=row.layout,
        convention=row.convention,
        window_steps=row.window_steps,
        config_fingerprint=row.config_fingerprint,
        baseline_run=row.baseline_run,
        last_report_ts=unix(row.last_report_at),
        window_provisional=bool(row.window_provisional),
    )


def find_run(conn: Connection, name: str) -> RunInfo | None:
    row = conn.execute(select(RUNS).where(RUNS.c.name == name)).first()
    return None if row is None else run_info(row)


def get_run(conn: Connection, name: str) -> RunInfo:
    """The run named ``name``; :class:`NotFoundError` (404) if there is none."""
    run = find_run(conn, name)
    if run is None:
        raise NotFoundError(f"run {name!r} not found")
    return run
