"""Snapshots to Prometheus metric families (the formatting half of a scrape)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)

from ..reads.status import STATUSES
from .catalog import BY_NAME, FAMILIES, Family
from .state import EVENT_KINDS, EVENT_SLOTS, PHASES, TAGS, RunSnapshot, Snapshot


def _new(f: Family) -> Metric:
    if f.kind == "gauge":
        return GaugeMetricFamily(f.name, f.help, labels=f.labels)
    if f.kind == "counter":
        return CounterMetricFamily(f.name, f.help, labels=f.labels)
    if f.kind == "info":
        return InfoMetricFamily(f.name.removesuffix("_info"), f.help, labels=f.labels[:1])
    return Metric(f.name, f.help, "summary")


def empty_families() -> list[Metric]:
    """One empty family per catalog entry (for ``describe()``: names, no database read)."""
    return [_new(f) for f in FAMILIES]


class _Builder:
    def __init__(self) -> None:
        self.families = {f.name: _new(f) for f in FAMILIES}

    def add(self, name: str, labels: Sequence[str], value: float | None) -> None:
        if value is None:
            return
        fam = self.families[name]
        assert isinstance(fam, GaugeMetricFamily | CounterMetricFamily)
        fam.add_metric(list(labels), float(value))

    def run(self, s: RunSnapshot) -> None:
        run = (s.name,)
        c = s.convention
        info = self.families["stepwatch_run_info"]
        assert isinstance(info, InfoMetricFamily)
        info.add_metric(
            [s.name],
            {
                "convention": c.id,
                "formula": c.formula,
                "dtype": c.dtype,
                "device": c.device,
                "peak_source": c.peak_source,
            },
        )
        for status in STATUSES:
            self.add("stepwatch_run_status", (s.name, status), 1.0 if s.status == status else 0.0)
        self.add("stepwatch_run_world_size_ranks", run, s.world_size)
        self.add("stepwatch_run_reporting_ranks", run, s.ranks_reporting)
        self.add("stepwatch_run_steps_total", run, s.last_step)
        self.add("stepwatch_run_tokens_total", run, s.tokens_total)
        self.add("stepwatch_run_last_step_timestamp_seconds", run, s.last_step_ts)
        self.add("stepwatch_run_last_report_timestamp_seconds", run, s.last_report_ts)
        self.add("stepwatch_run_hang_threshold_seconds", run, s.hang_threshold_s)
        if s.rates is not None:
            r = s.rates
            self.add("stepwatch_run_step_time_seconds", run, r.step_time_s)
            self.add("stepwatch_run_tokens_per_second", run, r.tokens_per_s)
            self.add("stepwatch_run_data_wait_seconds", run, r.data_wait_s)
            self.add("stepwatch_run_padding_ratio", run, r.padding_ratio)
            if c.mfu_scale is not None:
                self.add("stepwatch_run_mfu_ratio", run, r.tokens_per_s * c.mfu_scale)
            if c.hfu_scale is not None:
                self.add("stepwatch_run_hfu_ratio", run, r.tokens_per_s * c.hfu_scale)
        if s.baseline is not None:
            b = s.baseline
            self.add("stepwatch_run_baseline_step_time_seconds", run, b.step_time_s)
            self.add("stepwatch_run_baseline_tokens_per_second", run, b.tokens_per_s)
            if c.mfu_scale is not None:
                self.add("stepwatch_run_baseline_mfu_ratio", run, b.tokens_per_s * c.mfu_scale)
        if s.breakdown is not None:
            for phase in PHASES:
                self.add("stepwatch_run_breakdown_seconds", (s.name, phase), s.breakdown.get(phase))
        self.add("stepwatch_run_overlap_ratio", run, s.overlap_ratio)
        for tag in TAGS:
            self.add("stepwatch_run_tagged_steps", (s.name, tag), s.tagged.get(tag, 0))
        for kind, cause in EVENT_SLOTS:
            self.add("stepwatch_run_open_events", (s.name, kind, cause), s.events_open.get((kind, cause), 0))
        for kind in EVENT_KINDS:
            self.add("stepwatch_run_events_total", (s.name, kind), s.events_total.get(kind, 0))
        for quantity, dist in s.distributions.items():
            name = f"stepwatch_run_rank_{quantity}_seconds"
            fam = self.families[name]
            for q, v in dist.quantiles:
                fam.add_sample(name, {"run": s.name, "quantile": repr(q)}, v)
            fam.add_sample(name + "_count", {"run": s.name}, float(dist.count))
            fam.add_sample(name + "_sum", {"run": s.name}, dist.total)
        for rs in s.ranks:
            labels = (s.name, str(rs.rank), rs.host, rs.gpu)
            for quantity, v in rs.values.items():
                self.add(f"stepwatch_rank_{quantity}_seconds", labels, v)
        for fr in s.flagged:
            flag = (s.name, str(fr.rank), fr.host, fr.gpu, fr.cause)
            self.add("stepwatch_straggler_cost_seconds", flag, fr.cost_seconds)
            self.add("stepwatch_straggler_cost_ratio", flag, min(1.0, max(0.0, fr.cost_ratio)))
            self.add("stepwatch_straggler_first_step", flag, fr.first_step)


def families(snapshot: Snapshot) -> Iterator[Metric]:
    """The families of one scrape; empty families are left out."""
    b = _Builder()
    b.add("stepwatch_metrics_state_up", (), 1.0 if snapshot.ok else 0.0)
    b.add("stepwatch_metrics_read_duration_seconds", (), snapshot.read_seconds)
    b.add("stepwatch_metrics_runs", ("active",), snapshot.runs_active)
    b.add("stepwatch_metrics_runs", ("exported",), len(snapshot.runs))
    for run in snapshot.runs:
        b.run(run)
    for name in BY_NAME:
        fam = b.families[name]
        if fam.samples:
            yield fam
