"""The custom collector behind ``/metrics``: fresh families from the database per scrape.

Nothing is registered per run or per rank: ``collect()`` reads the current state with a
fixed number of bounded queries (``read.py``), computes the snapshot with pure functions
(``state.py``) and yields new families (``families.py``), so the registry never grows.

Which runs and ranks appear is bounded by configuration: runs whose newest batch is
older than ``run_expiry_s`` disappear, at most ``max_runs`` runs (the most recently
reporting) are exported, and per-rank series exist only for a run's flagged ranks
(at most ``max_flagged``) and its ``top_k`` slowest; all ranks enter the quantiles.

The collector keeps a small per-run memory, never data that grows with a run: the frozen
baseline, the token count summed so far (so each scrape adds only the steps that
settled since the last one; the first scrape after a start sums the run once), the
longest checkpoint/eval step seen, and the complete window's census with its slowest
ranks by step time, read again when a rank stores a step of that window (its signature in
``job_steps``, ``read.window_signatures``) or after ``CENSUS_MAX_AGE_S``. That spares the
runs that store nothing between two scrapes (finished, stalled, or scraped more often
than they close windows). A running job's complete window moves between most scrapes:
there the census and the profiled summary are those the analysis worker stored when it
analysed the window (``summaries.py``), while the signature they were read at holds.
The complete window is then the newest one analysed: the window before the newest, or
the one before it until the analysis passes that. The memory holds at most
``4 x max_runs`` runs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace

from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from sqlalchemy import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError

from ..reads.runs import RunInfo
from ..reads.status import DEFAULT_RULE, RunStatus, StatusRule, run_states
from ..settings import Settings
from . import read, state, summaries
from .catalog import series_bound
from .families import empty_families, families

log = logging.getLogger(__name__)

#: A kept census is read again after this long whatever its signature: the one write
#: the signature does not see, ``stepwatch db prune`` rolling up the windows of a run
#: that stalled days ago but still reports, shows within it.
CENSUS_MAX_AGE_S = 300.0
#: Statuses after which no more steps are expected, so every step's tokens are counted.
SETTLED: frozenset[RunStatus] = frozenset({"finished", "stalled"})
#: A window of a run: ``(run_id, window)``.
Window = tuple[int, int]


@dataclass(frozen=True)
class ExporterConfig:
    max_runs: int = 50
    top_k: int = 8
    max_flagged: int = 16
    run_expiry_s: float = 3600.0
    recent_steps: int = 256
    baseline_steps: int = 100
    status_rule: StatusRule = DEFAULT_RULE

    @classmethod
    def from_settings(cls, s: Settings) -> ExporterConfig:
        return cls(
            max_runs=s.metrics_max_runs,
            top_k=s.metrics_top_k,
            max_flagged=s.metrics_max_flagged,
            run_expiry_s=s.metrics_run_expiry_s,
            recent_steps=s.metrics_recent_steps,
            baseline_steps=s.metrics_baseline_steps,
            status_rule=StatusRule.from_settings(s),
        )

    @property
    def series_bound(self) -> int:
        return series_bound(self.max_runs, self.top_k, self.max_flagged)


@dataclass(frozen=True)
class _Census:
    """A window's census as read, with the signature it was read at
    (:func:`read.window_signatures`) and, for a run without a profiler, its slowest ranks."""

    window: int
    signature: read.Signature
    census: read.WindowCensus
    #: When it was read (the collector's clock).
    read_at: float
    top: tuple[tuple[int, float], ...] | None = None


@dataclass
class _Memory:
    baseline: state.RunBaseline | None = None
    baseline_frozen: bool = False
    tokens_through: int = -1
    tokens_total: float = 0.0
    longest_tagged_s: float = 0.0
    #: The complete window's census: read again when its signature changes or it ages.
    census: _Census | None = None
    #: The complete window last exported: a census the analysis stored of an older one
    #: is not used, so that the exported window never steps back.
    exported: int = -1


class RunStateCollector(Collector):
    def __init__(
        self, engine: Engine, config: ExporterConfig | None = None, *, clock: Callable[[], float] = time.time
    ) -> None:
        self.engine = engine
        self.config = config or ExporterConfig()
        self._clock = clock
        self._memory: OrderedDict[int, _Memory] = OrderedDict()
        self._lock = threading.Lock()  # one scrape at a time: the memory is read-modify-write

    def describe(self) -> Iterable[Metric]:
        # Names only: registering the collector must not read the database.
        return empty_families()

    def collect(self) -> Iterator[Metric]:
        t0 = time.perf_counter()
        try:
            with self._lock:
                snapshot = self.snapshot()
        except SQLAlchemyError as exc:
            log.warning("metrics: reading the collector state failed: %s", exc.__class__.__name__)
            snapshot = state.Snapshot(runs=(), runs_active=0, ok=False)
        snapshot = state.Snapshot(
            runs=snapshot.runs,
            runs_active=snapshot.runs_active,
            ok=snapshot.ok,
            read_seconds=time.perf_counter() - t0,
        )
        yield from families(snapshot)

    # -- reading -------------------------------------------------------------------------
    def snapshot(self) -> state.Snapshot:
        cfg = self.config
        now = self._clock()
        with self.engine.connect() as conn:
            chosen, active = read.reporting_runs(conn, since=now - cfg.run_expiry_s, limit=cfg.max_runs)
            runs = self._runs(conn, chosen) if chosen else []
        return state.Snapshot(runs=runs, runs_active=active, ok=True)

    def _runs(self, conn: Connection, heads: list[RunInfo]) -> list[state.RunSnapshot]:
        """Batched reads for all exported runs, then one snapshot per run."""
        cfg = self.config
        ids = [h.id for h in heads]
        mem = self._remember(ids)
        tails = read.tails(conn, ids)
        tail = {h.id: tails.get(h.id, read.RunTail(None, None, None)) for h in heads}
        steps = read.recent_steps(conn, {i: (t.last_step or 0) - cfg.recent_steps for i, t in tail.items()})
        # The ranks reporting: those whose newest step is in the previous window or later,
        # counted in the status query's pass over the ranks.
        since = {h.id: state.reporting_since(tail[h.id].last_step, h.window_steps) for h in heads}
        states = run_states(conn, ids, rule=cfg.status_rule, now=self._clock(), since_step=since)
        # Tokens: only the steps that settled since the previous scrape are summed; all of
        # them once the run is done, so that the total ends equal to the API's.
        spans = {
            h.id: (
                mem[h.id].tokens_through,
                state.settled_through(t.last_step, h.window_steps, done=states[h.id].status in SETTLED),
            )
            for h in heads
            if (t := tail[h.id]).last_step is not None
        }
        added = read.token_sums(conn, spans)
        reporting = {i: s.ranks_since for i, s in states.items()}
        events = read.open_events(conn, ids)
        ranks = _read_ranks(conn, heads, tail, reporting, events, cfg, mem, self._clock())
        totals = read.event_totals(conn, ids)

        views = []
        for h in heads:
            m = mem[h.id]
            if h.id in added:
                m.tokens_total += added[h.id]
                m.tokens_through = max(m.tokens_through, spans[h.id][1])
            m.longest_tagged_s = max(m.longest_tagged_s, state.longest_tagged_step(steps[h.id]))
            if not m.baseline_frozen:
                self._update_baseline(conn, h, m, tail[h.id].last_step)
            views.append(replace(ranks[h.id], status=states[h.id].status))
        identity = read.rank_identity(conn, {v.head.id: v.selected for v in views})
        rule = self.config.status_rule
        return [
            _snapshot(v, mem[v.head.id], steps[v.head.id], totals[v.head.id], identity, rule) for v in views
        ]

    def _update_baseline(self, conn: Connection, h: RunInfo, m: _Memory, last_step: int | None) -> None:
        rows = read.first_untagged_steps(conn, h.id, self.config.baseline_steps)
        m.baseline = state.baseline_of(rows, h.dp_size)
        b = m.baseline
        if (
            b is not None
            and b.steps >= self.config.baseline_steps
            and last_step is not None
            and state.settled_through(last_step, h.window_steps) >= b.last_step
        ):
            m.baseline_frozen = True  # every rank has reported these steps: never read again

    def _remember(self, ids: list[int]) -> dict[int, _Memory]:
        out = {}
        for run_id in ids:
            m = self._memory.get(run_id)
            if m is None:
                m = self._memory[run_id] = _Memory()
            self._memory.move_to_end(run_id)
            out[run_id] = m
        while len(self._memory) > 4 * self.config.max_runs:
            self._memory.popitem(last=False)
        return out


@dataclass(frozen=True)
class _View:
    """One run's per-rank picture, before the selected ranks' identities are read."""

    head: RunInfo
    tail: read.RunTail
    reporting: int
    #: Per-rank values of the selected ranks only.
    values: dict[int, dict[str, float]]
    distributions: dict[str, state.Distribution]
    events: list[state.EventRow]
    flagged: list[tuple[int, str, state.EventRow]]
    selected: list[int]
    breakdown: dict[str, float] | None
    overlap: float | None
    status: RunStatus = "live"


def _read_ranks(
    conn: Connection,
    heads: list[RunInfo],
    tail: dict[int, read.RunTail],
    reporting: dict[int, int],
    events: dict[int, list[state.EventRow]],
    cfg: ExporterConfig,
    mem: dict[int, _Memory],
    now: float,
) -> dict[int, _View]:
    """Each run's ranks as the database summarises them: which window is complete, the
    quantiles across ranks, the breakdown means and the top-K, then the rows of the
    selected (flagged and slowest) ranks only."""
    newest = {h.id: state.windows_in_view(tail[h.id].last_step, h.window_steps)[1] for h in heads}
    prev = {i: max(0, w - 1) for i, w in newest.items()}
    # The census the analysis stored when it analysed the window (``summaries.py``): used
    # while its window is the previous one, or the one before while the analysis has not
    # yet passed the previous, and no rank stored a step of it since (its signature).
    # Otherwise the previous window, and the newest only where the previous has no row;
    # the previous window's census is read again only if its signature changed since the
    # collector last read it.
    sizes = {h.id: h.window_steps for h in heads}
    stored = summaries.stored(conn, list(newest))
    asked = {(i, w, sizes[i]) for i, w in prev.items()}
    asked |= {(i, r.window, sizes[i]) for i, s in stored.items() for r in (s.census, s.profiled) if r}
    signatures = read.window_signatures(conn, asked)
    analysed = {
        i: s.census
        for i, s in stored.items()
        if s.census
        and max(prev[i] - 1, mem[i].exported) <= s.census.window <= prev[i]
        and _holds(i, s.census, signatures)
    }
    rest = {i: w for i, w in prev.items() if i not in analysed}
    kept = {i: k for i, w in rest.items() if (k := _kept_census(mem[i], w, signatures.get((i, w)), now))}
    at_prev = {i: k.census for i, k in kept.items()}
    read_now = read.window_census(conn, {i: w for i, w in rest.items() if i not in kept})
    for i, census_read in read_now.items():
        mem[i].census = _Census(prev[i], signatures.get((i, prev[i]), (0, 0)), census_read, now)
    at_prev |= read_now
    first = {i: newest[i] for i, w in rest.items() if i not in at_prev and newest[i] != w}
    at_newest = read.window_census(conn, first)
    census = (
        {i: {c.window: c.census} for i, c in analysed.items()}
        | {i: {prev[i]: c} for i, c in at_prev.items()}
        | {i: {newest[i]: c} for i, c in at_newest.items()}
    )
    complete = {
        i: analysed[i].window
        if i in analysed
        else state.complete_window({w: c.ranks for w, c in census.get(i, {}).items()}, w)
        for i, w in newest.items()
    }
    for i, w in complete.items():
        if w is not None:
            mem[i].exported = max(mem[i].exported, w)
    profiled_at = {h.id: w for h in heads if (w := tail[h.id].last_profiled_window) is not None}
    # The newest profiled window's summary as the analysis stored it, while unchanged.
    analysed_prof = {
        i: s.profiled
        for i, s in stored.items()
        if s.profiled and s.profiled.window == profiled_at.get(i) and _holds(i, s.profiled, signatures)
    }
    profiled = {i: p.summary for i, p in analysed_prof.items()}
    profiled |= read.profiled_summary(conn, {i: w for i, w in profiled_at.items() if i not in analysed_prof})
    # Per run and quantity: (values, total, quantiles if the database computed them, window).
    dists: dict[int, dict[str, tuple[int, float, read.Quantiles | None, int | None]]] = {}
    none: tuple[int, float, read.Quantiles | None, int | None] = (0, 0.0, None, None)
    for h in heads:
        done, p_at = complete[h.id], profiled_at.get(h.id)
        c = census.get(h.id, {}).get(done) if done is not None else None
        ps = profiled.get(h.id)
        cq, pq = (c.quantiles if c else None) or {}, (ps.quantiles if ps else None) or {}
        dists[h.id] = {
            "step_time": (c.ranks, c.step_time_total, cq.get("step_time"), done) if c else none,
            "data_wait": (c.ranks, c.data_wait_total, cq.get("data_wait"), done) if c else none,
            "compute": (ps.ranks, ps.compute_total, pq.get("compute"), p_at) if ps else none,
            "comm_wait": (ps.comm_wait_ranks, ps.comm_wait_total, pq.get("comm_wait"), p_at) if ps else none,
        }
    # Where the database did not interpolate the quantiles (SQLite), it returns the
    # order statistics they need.
    wanted = {
        h.id: {
            q: (w, state.order_positions(n))
            for q, (n, _, qs, w) in dists[h.id].items()
            if n and qs is None and w is not None
        }
        for h in heads
    }
    stats = read.order_statistics(conn, {i: q for i, q in wanted.items() if q})
    for i in wanted:  # the census' quantiles kept with it, on SQLite too
        memo = mem[i].census
        if i in analysed:
            continue
        if memo is not None and memo.census.quantiles is None and memo.window == complete[i]:
            n, found = memo.census.ranks, stats.get(i, {})
            interpolated = {q: state.interpolate(n, found.get(q, {})) for q in read.CENSUS_QUANTITIES}
            mem[i].census = replace(memo, census=replace(memo.census, quantiles=interpolated))
    key = {i: "compute" if d["compute"][0] else "step_time" for i, d in dists.items()}
    top_at = {
        i: (key[i], d[key[i]][3]) for i, d in dists.items() if d[key[i]][0] and d[key[i]][3] is not None
    }
    # The slowest ranks the analysis stored with the census or profiled summary in use;
    # by step time (no profiler), those of a kept census are kept with it.
    top: dict[int, list[tuple[int, float]]] = {}
    for i, (qty, at) in top_at.items():
        t = _stored_top(analysed.get(i), analysed_prof.get(i), qty, at, cfg.top_k)
        if t is None and i not in analysed:  # the memory's census is not the one in use
            t = _kept_top(mem[i], qty, at)
        if t is not None:
            top[i] = list(t)
    if cfg.top_k > 0:
        missing = {i: (q, w) for i, (q, w) in top_at.items() if i not in top and w is not None}
        top |= read.top_ranks(conn, missing, cfg.top_k)
        for i, (q, w) in top_at.items():
            memo = mem[i].census
            if q == "step_time" and memo is not None and memo.window == w and memo.top is None:
                mem[i].census = replace(memo, top=tuple(top[i]))
    else:
        top = {}
    flagged = {h.id: state.flagged_ranks(events[h.id], cfg.max_flagged) for h in heads}
    selected = {}
    for h in heads:
        candidates = {rank: {key[h.id]: v} for rank, v in top.get(h.id, [])}
        slowest = state.slowest(candidates, cfg.top_k)
        selected[h.id] = list(dict.fromkeys([r for r, _, _ in flagged[h.id]] + slowest))
    rows = read.rank_rows(
        conn,
        {
            h.id: ({w for w in (complete[h.id], profiled_at.get(h.id)) if w is not None}, selected[h.id])
            for h in heads
        },
    )
    views = {}
    for h in heads:
        chosen = {r.rank: r for r in rows[h.id] if r.window == complete[h.id]}
        prof = {r.rank: r for r in rows[h.id] if r.window == profiled_at.get(h.id)}
        distributions = {}
        for q, (n, total, qs, _) in dists[h.id].items():
            if n:
                quantiles = qs if qs is not None else state.interpolate(n, stats.get(h.id, {}).get(q, {}))
                distributions[q] = state.Distribution(quantiles=quantiles, count=n, total=total)
        summary = profiled.get(h.id)
        parts, overlap = state.breakdown(summary.means if summary else None)
        views[h.id] = _View(
            head=h,
            tail=tail[h.id],
            reporting=reporting.get(h.id, 0),
            values=state.rank_values(chosen, prof),
            distributions=distributions,
            events=events[h.id],
            flagged=flagged[h.id],
            selected=selected[h.id],
            breakdown=parts,
            overlap=overlap,
        )
    return views


def _kept_census(m: _Memory, window: int, signature: read.Signature | None, now: float) -> _Census | None:
    """The census remembered for ``window`` if no step of it was stored since it was read,
    at most ``CENSUS_MAX_AGE_S`` ago."""
    c = m.census
    if c is None or signature is None or c.window != window or c.signature != signature:
        return None
    return c if 0 <= now - c.read_at < CENSUS_MAX_AGE_S else None


def _kept_top(m: _Memory, quantity: str, window: int | None) -> tuple[tuple[int, float], ...] | None:
    """The slowest ranks by step time remembered with the census in use for ``window``."""
    c = m.census
    if quantity != "step_time" or c is None or c.window != window:
        return None
    return c.top


def _holds(
    run_id: int, row: summaries.Census | summaries.Profiled, sigs: Mapping[Window, read.Signature]
) -> bool:
    """Whether no rank stored a step of the row's window since the analysis summarised it."""
    return sigs.get((run_id, row.window)) == row.signature


def _stored_top(
    census: summaries.Census | None,
    prof: summaries.Profiled | None,
    quantity: str,
    window: int | None,
    k: int,
) -> tuple[tuple[int, float], ...] | None:
    """The ``k`` slowest ranks the analysis stored with the census or the profiled summary
    in use for ``window``, if it stored as many (or every rank)."""
    if quantity == "step_time" and census is not None and census.window == window:
        top, ranks = census.top, census.census.ranks
    elif quantity == "compute" and prof is not None and prof.window == window:
        top, ranks = prof.top, prof.summary.ranks
    else:
        return None
    return top[:k] if len(top) >= min(k, ranks) else None


def _snapshot(
    v: _View,
    m: _Memory,
    steps: list[state.JobStepSums],
    totals: dict[str, int],
    identity: dict[tuple[int, int], tuple[str, int]],
    rule: StatusRule,
) -> state.RunSnapshot:
    h = v.head

    def who(rank: int) -> tuple[str, str]:
        host, local = identity.get((h.id, rank), ("", -1))
        return host, (str(local) if local >= 0 else "")

    ranks = [
        state.RankSeries(rank=rank, host=who(rank)[0], gpu=who(rank)[1], values=v.values[rank])
        for rank in v.selected
        if rank in v.values
    ]
    flagged = [
        state.FlaggedRank(
            rank=rank,
            host=who(rank)[0] or ev_host,
            gpu=who(rank)[1],
            cause=state.cause_label(ev.cause),
            cost_seconds=ev.cost_seconds,
            cost_ratio=ev.cost_ratio,
            first_step=ev.first_step,
        )
        for rank, ev_host, ev in v.flagged
    ]
    return state.RunSnapshot(
        name=h.name,
        world_size=h.world_size,
        convention=state.convention_of(h.convention, h.world_size),
        last_report_ts=h.last_report_ts or 0.0,
        ranks_reporting=v.reporting,
        last_step=v.tail.last_step,
        last_step_ts=v.tail.last_step_ts,
        tokens_total=m.tokens_total if v.tail.last_step is not None else None,
        status=v.status,
        rates=state.current_rates(steps, h.dp_size),
        baseline=m.baseline,
        hang_threshold_s=state.hang_threshold(steps, m.longest_tagged_s, rule) if steps else None,
        tagged=state.tagged_counts(steps),
        breakdown=v.breakdown,
        overlap_ratio=v.overlap,
        distributions=v.distributions,
        ranks=ranks,
        flagged=flagged,
        events_open=state.open_event_counts(v.events),
        events_total=totals,
    )
