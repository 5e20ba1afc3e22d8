"""Every metric family ``/metrics`` exports from the collector's state, in one table.

Names follow DESIGN §6: a ``stepwatch_`` prefix, base units (``_seconds``), ratios in
0-1 as ``_ratio``, counters ``_total``. Labels: ``run`` on everything per run; per-rank
families add ``rank`` and dcgm-exporter's ``Hostname`` and ``gpu`` (the local rank, which
is the CUDA device index under torchrun) so that a panel can join a rank with its GPU's
telemetry, e.g. ``... * on (Hostname, gpu) group_left DCGM_FI_DEV_SM_CLOCK``.

Each family declares its *scope*, which fixes how many series it can have; the series
bound of the whole exposition (:func:`series_bound`) is computed from this table, and a
test checks that no input, however many runs, ranks or flags, exceeds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..reads.status import STATUSES
from .state import EVENT_KINDS, EVENT_SLOTS, PHASES, QUANTILES, TAGS

Kind = Literal["gauge", "counter", "summary", "info"]
#: global: one series; run: one per run; run_enum: ``enum`` per run; run_quantile: a
#: summary (quantiles + count + sum) per run; rank: one per exported rank of a run;
#: flagged: one per flagged rank of a run.
Scope = Literal["global", "global_enum", "run", "run_enum", "run_quantile", "rank", "flagged"]

RUN = ("run",)
RANK = ("run", "rank", "Hostname", "gpu")
FLAG = (*RANK, "cause")


@dataclass(frozen=True)
class Family:
    name: str
    kind: Kind
    scope: Scope
    help: str
    labels: tuple[str, ...] = ()
    enum: int = 1

    @property
    def unit(self) -> str:
        """The base unit the name ends with ("" for counts and info)."""
        for unit in ("seconds", "ratio", "tokens_per_second"):
            if self.name.endswith("_" + unit) or self.name.endswith(f"_{unit}_total"):
                return unit
        return ""


_SCOPE_LABELS: dict[str, tuple[str, ...]] = {
    "global": (),
    "run": RUN,
    "run_quantile": RUN,
    "rank": RANK,
    "flagged": FLAG,
}


def _g(
    name: str,
    scope: Scope,
    help: str,
    *,
    kind: Kind = "gauge",
    labels: tuple[str, ...] | None = None,
    enum: int = 1,
) -> Family:
    return Family(name, kind, scope, help, labels if labels is not None else _SCOPE_LABELS[scope], enum)


def _c(name: str, scope: Scope, help: str, *, labels: tuple[str, ...] | None = None, enum: int = 1) -> Family:
    return _g(name, scope, help, kind="counter", labels=labels, enum=enum)


def _q(name: str, help: str) -> Family:
    return _g(name, "run_quantile", help, kind="summary")


FAMILIES: tuple[Family, ...] = (
    # -- the exporter itself ------------------------------------------------------------
    _g("stepwatch_metrics_state_up", "global",
       "1 if this scrape read the collector's database, 0 if the read failed (run series are then absent)."),
    _g("stepwatch_metrics_read_duration_seconds", "global", "Time this scrape spent reading the database."),
    _g("stepwatch_metrics_runs", "global_enum", labels=("state",), enum=2,
       help="Runs that reported within the expiry (state=active), runs exported (state=exported, capped)."),
    # -- a run ----------------------------------------------------------------------------
    _g("stepwatch_run_info", "run", kind="info",
       labels=("run", "convention", "formula", "dtype", "device", "peak_source"),
       help="The run's FLOPs convention: an MFU is only comparable between runs with the same convention."),
    _g("stepwatch_run_status", "run_enum", labels=("run", "status"), enum=len(STATUSES),
       help="1 for the run's status, 0 for the others (live, finished: every rank sent its final batch, "
       "stalled: no step for longer than the hang threshold, hung: an open hang event)."),
    _g("stepwatch_run_world_size_ranks", "run", "Ranks in the run (world size)."),
    _g("stepwatch_run_reporting_ranks", "run", "Ranks that reported one of the run's two newest windows."),
    _c("stepwatch_run_steps_total", "run", "Newest optimizer step reported by any rank."),
    _c("stepwatch_run_tokens_total", "run",
       "Global non-padding tokens processed, estimated from the reporting data-parallel replicas "
       "(lags the newest step by two windows while the run steps, so it never goes back; "
       "complete once the run finished or stalled)."),
    _g("stepwatch_run_last_step_timestamp_seconds", "run",
       "Unix time (training host's clock) at which the newest reported step ended."),
    _g("stepwatch_run_last_report_timestamp_seconds", "run",
       "Unix time (collector's clock) of the newest batch received from the run."),
    _g("stepwatch_run_step_time_seconds", "run",
       "Step time, mean over the newest untagged steps (warm-up, checkpoint and eval steps excluded)."),
    _g("stepwatch_run_tokens_per_second", "run",
       "Global non-padding tokens per second over the newest untagged steps."),
    _g("stepwatch_run_mfu_ratio", "run",
       "Model FLOPs utilisation (0-1), newest untagged steps; absent when the peak FLOP/s is unknown."),
    _g("stepwatch_run_hfu_ratio", "run",
       "Hardware FLOPs utilisation (0-1, recomputation included); present when the recompute is known."),
    _g("stepwatch_run_data_wait_seconds", "run",
       "Data-loader wait per step of the slowest-waiting rank, mean over the newest untagged steps."),
    _g("stepwatch_run_padding_ratio", "run",
       "Share of padding in the input tokens (0-1); present when the agent reports padded tokens."),
    _g("stepwatch_run_baseline_step_time_seconds", "run",
       "Median step time of the run's first untagged steps after warm-up (its frozen baseline)."),
    _g("stepwatch_run_baseline_tokens_per_second", "run", "Tokens per second over the run's baseline steps."),
    _g("stepwatch_run_baseline_mfu_ratio", "run", "MFU (0-1) over the run's baseline steps."),
    _g("stepwatch_run_hang_threshold_seconds", "run",
       "No step for longer than this is a hang: max(10 x median step time, 60 s, 1.5 x the longest "
       "checkpoint or eval step seen)."),
    _g("stepwatch_run_overlap_ratio", "run",
       "Communication overlapped with compute / all communication (0-1), newest profiled window."),
    _g("stepwatch_run_breakdown_seconds", "run_enum", labels=("run", "phase"), enum=len(PHASES),
       help="Seconds per step in each part of the step (compute, comm_overlapped, comm_exposed, data_wait, "
       "idle; they sum to the step time), mean over ranks, newest profiled window."),
    _g("stepwatch_run_tagged_steps", "run_enum", labels=("run", "tag"), enum=len(TAGS),
       help="Steps tagged warmup, checkpoint or eval among the run's newest steps (masks alerts)."),
    _g("stepwatch_run_open_events", "run_enum", labels=("run", "kind", "cause"), enum=len(EVENT_SLOTS),
       help="Open straggler (by cause), regression and hang flags."),
    _c("stepwatch_run_events_total", "run_enum", "Flags ever opened, by kind.", labels=("run", "kind"),
       enum=len(EVENT_KINDS)),
    # -- across the ranks of a run (exact quantiles of one window) --------------------------
    _q("stepwatch_run_rank_step_time_seconds",
       "Step time across the run's ranks, newest complete window (a snapshot: count is ranks)."),
    _q("stepwatch_run_rank_data_wait_seconds",
       "Data-loader wait per step across the run's ranks, newest complete window (a snapshot)."),
    _q("stepwatch_run_rank_compute_seconds",
       "Compute-only time per step across the run's ranks, newest profiled window (a snapshot)."),
    _q("stepwatch_run_rank_comm_wait_seconds",
       "Collective wait (for the last peer) per step across the run's ranks, newest profiled window."),
    # -- selected ranks: flagged ones and the K slowest ------------------------------------
    _g("stepwatch_rank_step_time_seconds", "rank",
       "Mean step time of a flagged or top-K slowest rank, newest complete window."),
    _g("stepwatch_rank_data_wait_seconds", "rank",
       "Data-loader wait per step of a flagged or top-K slowest rank, newest complete window."),
    _g("stepwatch_rank_compute_seconds", "rank",
       "Compute-only time per step of a flagged or top-K slowest rank, newest profiled window."),
    _g("stepwatch_rank_comm_wait_seconds", "rank",
       "Collective wait per step of a flagged or top-K slowest rank, newest profiled window."),
    # -- stragglers (open flags) -------------------------------------------------------------
    _g("stepwatch_straggler_cost_seconds", "flagged",
       "Seconds per step the run would save if this flagged rank ran at its peers' median."),
    _g("stepwatch_straggler_cost_ratio", "flagged", "That saving as a share of the step time (0-1)."),
    _g("stepwatch_straggler_first_step", "flagged", "Step at which the open flag on this rank started."),
)  # fmt: skip

BY_NAME: dict[str, Family] = {f.name: f for f in FAMILIES}


def exposed_names(f: Family) -> tuple[str, ...]:
    """Sample names a family produces in the text exposition."""
    if f.kind == "summary":
        return (f.name, f.name + "_count", f.name + "_sum")
    return (f.name,)


def series_per_run(top_k: int, max_flagged: int) -> int:
    """Most series one run can add to the exposition."""
    n = 0
    for f in FAMILIES:
        if f.scope == "run":
            n += 1
        elif f.scope == "run_enum":
            n += f.enum
        elif f.scope == "run_quantile":
            n += len(QUANTILES) + 2
        elif f.scope == "rank":
            n += top_k + max_flagged
        elif f.scope == "flagged":
            n += max_flagged
    return n


def global_series() -> int:
    return sum(f.enum if f.scope == "global_enum" else 1 for f in FAMILIES if f.scope.startswith("global"))


def series_bound(max_runs: int, top_k: int, max_flagged: int) -> int:
    """Most series the run-state collector can export (the app's ingest counters aside)."""
    return global_series() + max_runs * series_per_run(top_k, max_flagged)
