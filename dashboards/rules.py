"""Prometheus recording and alert rules, built from the configuration.

Recording rules follow ``level:metric:operations`` and aggregate ``max by (run)``, so
several collector replicas exporting the same run (one database) count once. Alerts
carry ``severity`` and the annotations ``summary``, ``description`` and ``runbook_url``
(monitoring-mixin style).

Masking: the performance alerts (MFU drop, step-time regression, data-wait share) are
silent while any step tagged warm-up, checkpoint or eval was seen in the mask window;
the current values they compare already exclude tagged steps. The hang threshold that
the collector exports is widened by the longest checkpoint or eval step seen, so a long
checkpoint is not a hang.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config import DEFAULT, Config


@dataclass(frozen=True)
class Names:
    """Recording-rule names (used by the dashboards too)."""

    mfu: str
    step_time: str
    tokens_per_s: str
    data_wait_share: str
    mfu_vs_baseline: str
    step_time_vs_baseline: str
    masked: str
    step_silence: str
    report_age: str
    goodput: str
    calendar_efficiency: str
    breakdown_share: str

    @classmethod
    def of(cls, c: Config) -> Names:
        w, g, m = c.window, c.goodput_window, c.mask_window
        return cls(
            mfu=f"run:stepwatch_mfu_ratio:avg{w}",
            step_time=f"run:stepwatch_step_time_seconds:avg{w}",
            tokens_per_s=f"run:stepwatch_tokens_per_second:avg{w}",
            data_wait_share=f"run:stepwatch_data_wait_share_ratio:avg{w}",
            mfu_vs_baseline=f"run:stepwatch_mfu_vs_baseline_ratio:avg{w}",
            step_time_vs_baseline=f"run:stepwatch_step_time_vs_baseline_ratio:avg{w}",
            masked=f"run:stepwatch_alerts_masked:max{m}",
            step_silence="run:stepwatch_step_silence_seconds:now",
            report_age="run:stepwatch_report_age_seconds:now",
            goodput=f"run:stepwatch_goodput_tokens_per_second:rate{g}",
            calendar_efficiency=f"run:stepwatch_calendar_efficiency_ratio:rate{g}",
            breakdown_share="run_phase:stepwatch_breakdown_share_ratio:latest",
        )


def recording_rules(c: Config = DEFAULT) -> list[dict[str, str]]:
    n, s, w, g = Names.of(c), c.sel, c.window, c.goodput_window

    def avg(metric: str, window: str = w) -> str:
        return f"avg_over_time({metric}{{{s}}}[{window}])"

    def latest(metric: str, by: str = "run") -> str:
        return f"max by ({by}) ({metric}{{{s}}})"

    return [
        {"record": n.mfu, "expr": f"max by (run) ({avg('stepwatch_run_mfu_ratio')})"},
        {"record": n.step_time, "expr": f"max by (run) ({avg('stepwatch_run_step_time_seconds')})"},
        {"record": n.tokens_per_s, "expr": f"max by (run) ({avg('stepwatch_run_tokens_per_second')})"},
        {
            "record": n.data_wait_share,
            "expr": f"max by (run) ({avg('stepwatch_run_data_wait_seconds')}"
            f" / {avg('stepwatch_run_step_time_seconds')})",
        },
        {
            "record": n.mfu_vs_baseline,
            "expr": f"{n.mfu} / on (run) {latest('stepwatch_run_baseline_mfu_ratio')}",
        },
        {
            "record": n.step_time_vs_baseline,
            "expr": f"{n.step_time} / on (run) {latest('stepwatch_run_baseline_step_time_seconds')}",
        },
        {
            "record": n.masked,
            "expr": f"max by (run) (max_over_time(stepwatch_run_tagged_steps{{{s}}}[{c.mask_window}])"
            " > bool 0)",
        },
        {"record": n.step_silence, "expr": f"time() - {latest('stepwatch_run_last_step_timestamp_seconds')}"},
        {"record": n.report_age, "expr": f"time() - {latest('stepwatch_run_last_report_timestamp_seconds')}"},
        {"record": n.goodput, "expr": f"max by (run) (rate(stepwatch_run_tokens_total{{{s}}}[{g}]))"},
        {
            # Tokens per wall-clock second over tokens per productive second: the share of
            # wall time spent stepping (checkpoints, evaluation, restarts and gaps excluded).
            "record": n.calendar_efficiency,
            "expr": f"clamp_max({n.goodput} / on (run) "
            f"max by (run) ({avg('stepwatch_run_tokens_per_second', g)}), 1)",
        },
        {
            "record": n.breakdown_share,
            "expr": f"{latest('stepwatch_run_breakdown_seconds', 'run, phase')} / on (run) group_left "
            f"sum by (run) ({latest('stepwatch_run_breakdown_seconds', 'run, phase')})",
        },
    ]


def _alert(c: Config, name: str, expr: str, severity: str, summary: str, description: str) -> dict[str, Any]:
    return {
        "alert": name,
        "expr": expr,
        "for": c.for_[name],
        "labels": {"severity": severity},
        "annotations": {
            "summary": summary,
            "description": description,
            "runbook_url": c.runbook(name),
        },
    }


def alert_rules(c: Config = DEFAULT) -> list[dict[str, Any]]:
    n, s = Names.of(c), c.sel
    unmasked = f"unless on (run) ({n.masked} == 1)"
    pct = "{{ $value | humanizePercentage }}"
    run = "{{ $labels.run }}"
    return [
        _alert(
            c,
            "StepwatchMFUDrop",
            f"{n.mfu_vs_baseline} < {c.mfu_drop_below} {unmasked}",
            "warning",
            f"MFU of run {run} is {pct} of its baseline.",
            f"Over the last {c.window} the run's MFU stayed below {c.mfu_drop_below:.0%} of its own "
            "post-warm-up baseline (warm-up, checkpoint and eval steps masked). The time-breakdown "
            "dashboard shows which part of the step grew; check open straggler and regression flags.",
        ),
        _alert(
            c,
            "StepwatchStepTimeRegression",
            f"{n.step_time_vs_baseline} > {c.step_time_above} {unmasked}",
            "warning",
            f'Step time of run {run} is {{{{ $value | printf "%.2f" }}}}x its baseline.',
            f"Over the last {c.window} the mean step time stayed above {c.step_time_above}x the run's "
            "post-warm-up baseline (tagged steps masked). Compare the breakdown before and after the "
            "change: exposed communication, data wait or compute.",
        ),
        _alert(
            c,
            "StepwatchDataWaitHigh",
            f"{n.data_wait_share} > {c.data_wait_share_above} {unmasked}",
            "warning",
            f"Run {run} waits for data {pct} of each step.",
            f"The slowest-waiting rank spends more than {c.data_wait_share_above:.0%} of the step time "
            "blocked in the data loader. Look for a data straggler on the ranks dashboard, loader "
            "workers, storage throughput or a shard that is heavier than the others.",
        ),
        _alert(
            c,
            "StepwatchStragglerPersisting",
            f"max by (run, rank, Hostname, gpu, cause) (stepwatch_straggler_cost_ratio{{{s}}})"
            f" > {c.straggler_cost_above}",
            "warning",
            "Rank {{ $labels.rank }} ({{ $labels.Hostname }}, GPU {{ $labels.gpu }}) of run "
            + run
            + " is a {{ $labels.cause }} straggler costing "
            + pct
            + " of each step.",
            "stepwatch flagged this rank against its peer group and the flag stayed open. The cost is "
            "how much shorter each step would be if the rank ran at its peers' median. The ranks "
            "dashboard shows its compute, collective wait and data wait against the other ranks.",
        ),
        _alert(
            c,
            "StepwatchRegressionFlagged",
            f'max by (run) (stepwatch_run_open_events{{{s}, kind="regression"}}) > 0',
            "warning",
            f"stepwatch flagged a regression in run {run}.",
            "The regression detector found a sustained change of MFU or step time against the run's "
            "baseline; the event (GET /api/v1/runs/{run}/events) names the step and the part of the "
            "breakdown that moved.",
        ),
        _alert(
            c,
            "StepwatchRunHung",
            f"({n.step_silence} > on (run) max by (run) (stepwatch_run_hang_threshold_seconds{{{s}}}))"
            f' or on (run) (max by (run) (stepwatch_run_open_events{{{s}, kind="hang"}}) > 0)',
            "critical",
            f"Run {run} has made no step beyond its hang threshold.",
            "No rank reported a step for longer than max(10 x the median step time, 60 s, 1.5 x the "
            "longest checkpoint), or the hang detector flagged the run. A finished run also stops "
            "stepping: it reads as hung until it expires from /metrics.",
        ),
        _alert(
            c,
            "StepwatchRunStoppedReporting",
            f"{n.report_age} > {c.stopped_reporting_s}",
            "warning",
            f"Run {run} has sent nothing for {{{{ $value | humanizeDuration }}}}.",
            f"The collector received no batch from the run for more than {c.stopped_reporting_s} s: the "
            "job ended or crashed, or its agents cannot reach the collector (the agents buffer and "
            "count what they drop).",
        ),
        _alert(
            c,
            "StepwatchCollectorDown",
            f"(up{{{s}}} == 0) or (stepwatch_metrics_state_up{{{s}}} == 0) or absent(up{{{s}}})",
            "critical",
            "The stepwatch collector cannot be scraped or cannot read its database.",
            "Prometheus cannot scrape the collector, or the collector cannot read its database, so "
            "no run series are exported and no run alert can fire. Agents keep training and buffer "
            "their windows while the collector is away.",
        ),
    ]


def rule_groups(c: Config = DEFAULT) -> dict[str, Any]:
    # One group: rules of a group run in order, so each alert sees the recorded values of
    # the same evaluation (across groups it could see the previous one).
    return {"groups": [{"name": "stepwatch", "rules": recording_rules(c) + alert_rules(c)}]}
