"""A window's census across all of a run's ranks, computed once, when the analysis
worker analyses the window, and read by every scrape after it.

A scrape of a running job used to pass over every rank's row of the complete window
(quantiles and totals of step time and data wait, the slowest ranks) and of the newest
profiled window (the breakdown, compute and collective-wait quantiles), because the
complete window moves between most scrapes: at 16,384 ranks that was 2.2x the 1,024-rank
scrape. The worker already waits for every rank of a window before it analyses it, so it
computes the same figures there, with the exporter's own queries (:mod:`.read`), and
stores them in ``window_summaries``: one row per run and kind (``census``, ``profiled``),
its newest. The scrape then reads at most two rows per run.

A row stands only while its window is unchanged: it carries the window's signature in
``job_steps`` (:func:`read.window_signatures`) read *before* the census, and the exporter
uses it only while that signature holds. A rank that stores a step of the window after
the analysis (a batch overtaken by a later one: the analysis saw the rank past the
window's end) changes the signature, and the scrape reads the window itself again.
A profiler entry changes its window's rows without storing a step (an update of the
breakdown columns only, never of the census'), so the profiled summary is stored only
where readiness waited for every rank's entries (every rank says through which step it
sent them, ``ranks.profiles_through``), and not for a window analysed by grace, without
a late rank. ``stepwatch db prune`` deletes the rows of the windows it rolls up.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from sqlalchemy import Connection, delete, select

from ..storage.models import WindowSummary
from . import read, state

WS = WindowSummary.__table__

Kind = Literal["census", "profiled"]


@dataclass(frozen=True, slots=True)
class Census:
    """The ``census`` row: a window's census with its quantiles, and its slowest ranks by step time."""

    window: int
    signature: read.Signature
    census: read.WindowCensus
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True, slots=True)
class Profiled:
    """The ``profiled`` row: a profiled window's summary with its quantiles, and its
    slowest ranks by compute time."""

    window: int
    signature: read.Signature
    summary: read.ProfiledSummary
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True, slots=True)
class Stored:
    """A run's stored rows, either absent."""

    census: Census | None = None
    profiled: Profiled | None = None


def _quantiles(
    conn: Connection, run_id: int, window: int, counts: Mapping[str, int]
) -> dict[str, read.Quantiles]:
    """Quantiles of the given quantities of one window where the database does not
    interpolate them itself (SQLite): the order statistics they need, interpolated as a
    scrape does (``collector._read_ranks``)."""
    wanted = {q: (window, state.order_positions(n)) for q, n in counts.items() if n}
    stats = read.order_statistics(conn, {run_id: wanted}).get(run_id, {}) if wanted else {}
    return {q: state.interpolate(n, stats.get(q, {})) for q, n in counts.items()}


def census_of(conn: Connection, run_id: int, window: int, window_steps: int, top_k: int) -> Census | None:
    """The census of ``window`` with its ``top_k`` slowest ranks by step time, computed by
    the queries a scrape runs (None: the window has no row)."""
    signature = _signature(conn, run_id, window, window_steps)
    census = read.window_census(conn, {run_id: window}).get(run_id) if signature else None
    if signature is None or census is None:
        return None
    if census.quantiles is None:
        counts = dict.fromkeys(read.CENSUS_QUANTITIES, census.ranks)
        census = replace(census, quantiles=_quantiles(conn, run_id, window, counts))
    top = read.top_ranks(conn, {run_id: ("step_time", window)}, top_k)[run_id] if top_k else []
    return Census(window, signature, census, tuple(top))


def profiled_of(conn: Connection, run_id: int, window: int, window_steps: int, top_k: int) -> Profiled | None:
    """The profiled summary of ``window`` with its ``top_k`` slowest ranks by compute
    time (None: no profiled row)."""
    signature = _signature(conn, run_id, window, window_steps)
    summary = read.profiled_summary(conn, {run_id: window}).get(run_id) if signature else None
    if signature is None or summary is None:
        return None
    if summary.quantiles is None:
        counts = {"compute": summary.ranks, "comm_wait": summary.comm_wait_ranks}
        summary = replace(summary, quantiles=_quantiles(conn, run_id, window, counts))
    top = read.top_ranks(conn, {run_id: ("compute", window)}, top_k)[run_id] if top_k else []
    return Profiled(window, signature, summary, tuple(top))


def _signature(conn: Connection, run_id: int, window: int, window_steps: int) -> read.Signature | None:
    # Read before the census: a step stored in between then shows as a changed signature.
    return read.window_signatures(conn, [(run_id, window, window_steps)]).get((run_id, window))


def store(conn: Connection, insert: Any, run_id: int, rows: Iterable[Census | Profiled | Kind]) -> None:
    """Upsert each row as its run's newest of its kind, or delete the run's row of a kind
    given by name (``insert``: the backend's ``INSERT ... ON CONFLICT`` for
    ``window_summaries``, ``Storage.insert``)."""
    for row in rows:
        if isinstance(row, str):
            conn.execute(delete(WindowSummary).where(WS.c.run_id == run_id, WS.c.kind == row))
            continue
        values = {
            "window": row.window,
            "steps": row.signature[0],
            "rank_steps": row.signature[1],
            "summary": _to_json(row),
        }
        kind: Kind = "census" if isinstance(row, Census) else "profiled"
        stmt = insert(WS).values(run_id=run_id, kind=kind, **values)
        conn.execute(stmt.on_conflict_do_update(index_elements=["run_id", "kind"], set_=values))


def stored(conn: Connection, ids: Iterable[int]) -> dict[int, Stored]:
    """Each run's stored rows (primary-key probes: at most two rows per run)."""
    ids = list(ids)
    out = {run_id: Stored() for run_id in ids}
    if not ids:
        return out
    census: dict[int, Census] = {}
    profiled: dict[int, Profiled] = {}
    for r in conn.execute(select(WS).where(WS.c.run_id.in_(ids))):
        sig = (int(r.steps), int(r.rank_steps))
        if r.kind == "census":
            census[r.run_id] = _census_of(int(r.window), sig, r.summary)
        elif r.kind == "profiled":
            profiled[r.run_id] = _profiled_of(int(r.window), sig, r.summary)
    return {i: Stored(census.get(i), profiled.get(i)) for i in ids}


# -- the JSON of a row: written and read here only ----------------------------------------


def _pairs(xs: Iterable[tuple[float, float]]) -> list[list[float]]:
    return [[a, b] for a, b in xs]


def _to_json(row: Census | Profiled) -> dict[str, Any]:
    if isinstance(row, Census):
        c = row.census
        return {
            "ranks": c.ranks,
            "step_time_total": c.step_time_total,
            "data_wait_total": c.data_wait_total,
            "quantiles": {q: _pairs(v) for q, v in (c.quantiles or {}).items()},
            "top": _pairs(row.top),
        }
    p = row.summary
    return {
        "ranks": p.ranks,
        "compute_total": p.compute_total,
        "comm_wait_ranks": p.comm_wait_ranks,
        "comm_wait_total": p.comm_wait_total,
        "means": dict(p.means),
        "quantiles": {q: _pairs(v) for q, v in (p.quantiles or {}).items()},
        "top": _pairs(row.top),
    }


def _qs(data: Mapping[str, Any]) -> dict[str, read.Quantiles]:
    return {q: tuple((float(a), float(b)) for a, b in v) for q, v in data.items()}


def _top(data: Iterable[Any]) -> tuple[tuple[int, float], ...]:
    return tuple((int(r), float(v)) for r, v in data)


def _census_of(window: int, signature: read.Signature, d: Mapping[str, Any]) -> Census:
    census = read.WindowCensus(
        ranks=int(d["ranks"]),
        step_time_total=float(d["step_time_total"]),
        data_wait_total=float(d["data_wait_total"]),
        quantiles=_qs(d["quantiles"]),
    )
    return Census(window, signature, census, _top(d["top"]))


def _profiled_of(window: int, signature: read.Signature, d: Mapping[str, Any]) -> Profiled:
    summary = read.ProfiledSummary(
        ranks=int(d["ranks"]),
        compute_total=float(d["compute_total"]),
        comm_wait_ranks=int(d["comm_wait_ranks"]),
        comm_wait_total=float(d["comm_wait_total"]),
        means={k: float(v) for k, v in d["means"].items()},
        quantiles=_qs(d["quantiles"]),
    )
    return Profiled(window, signature, summary, _top(d["top"]))
