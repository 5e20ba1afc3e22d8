"""The four Grafana dashboards, built with grafana-foundation-sdk (Grafana 11.6 types).

(a) run overview: MFU with its FLOPs convention, tokens/s, step time, progress and ETA,
    flags and firing alerts as annotations;
(b) time breakdown: the parts of a step stacked, their shares, the overlap ratio;
(c) ranks: heatmaps across ranks (exact quantiles) and of the flagged and slowest ranks,
    the straggler table with its cost;
(d) fleet: all runs side by side.

Queries aggregate ``max by (...)`` so that several collector replicas (one database)
count once. Every query is evaluated against a real Prometheus in the stack test.
"""

from __future__ import annotations

import json
from typing import Any

from grafana_foundation_sdk.builders import bargauge, heatmap, stat, table, timeseries
from grafana_foundation_sdk.builders.common import ReduceDataOptions, StackingConfig, VizLegendOptions
from grafana_foundation_sdk.builders.dashboard import (
    AnnotationQuery,
    Dashboard,
    DashboardLink,
    DatasourceVariable,
    QueryVariable,
    Row,
    TextBoxVariable,
)
from grafana_foundation_sdk.builders.heatmap import HeatmapColorOptions, RowsHeatmapOptions, YAxisConfig
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.cog import variants
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import (
    BigValueTextMode,
    FieldTextAlignment,
    HeatmapCellLayout,
    LegendDisplayMode,
    LegendPlacement,
    StackingMode,
)
from grafana_foundation_sdk.models.dashboard import (
    DashboardLinkType,
    DataSourceRef,
    DataTransformerConfig,
    DynamicConfigValue,
    VariableOption,
    VariableRefresh,
    VariableSort,
)
from grafana_foundation_sdk.models.heatmap import HeatmapColorMode
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from .config import DEFAULT, Config
from .rules import Names

DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
RUN = 'run="$run"'
TOKENS = "suffix: tok"
TOKENS_PER_S = "suffix: tok/s"


# -- building blocks -----------------------------------------------------------------------


def q(
    expr: str, legend: str = "__auto", *, ref: str = "A", instant: bool = False, table_: bool = False
) -> Dataquery:
    query = Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(DS)
    query = query.instant() if instant else query.range()
    if table_:
        query = query.format(PromQueryFormat.TABLE)
    return query


def _refs(queries: tuple[Dataquery, ...]) -> list[Builder[variants.Dataquery]]:
    return [qq.ref_id(chr(ord("A") + i)) for i, qq in enumerate(queries)]


def ts(
    title: str,
    desc: str,
    unit: str,
    *queries: Dataquery,
    stack: bool = False,
    lo: float | None = None,
    hi: float | None = None,
    w: int = 12,
    h: int = 8,
) -> timeseries.Panel:
    p = (
        timeseries.Panel()
        .title(title)
        .description(desc)
        .datasource(DS)
        .unit(unit)
        .targets(_refs(queries))
        .span(w)
        .height(h)
        .legend(
            VizLegendOptions()
            .show_legend(True)
            .display_mode(LegendDisplayMode.LIST)
            .placement(LegendPlacement.BOTTOM)
        )
    )
    if stack:
        p = p.stacking(StackingConfig().mode(StackingMode.NORMAL)).fill_opacity(60)
    if lo is not None:
        p = p.min(lo)
    if hi is not None:
        p = p.max(hi)
    return p


def st(
    title: str, desc: str, unit: str, *queries: Dataquery, w: int = 4, h: int = 4, name: bool = False
) -> stat.Panel:
    p = (
        stat.Panel()
        .title(title)
        .description(desc)
        .datasource(DS)
        .unit(unit)
        .targets(_refs(queries))
        .span(w)
        .height(h)
        .reduce_options(ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    )
    if name:
        p = p.text_mode(BigValueTextMode.NAME)
    return p


def heat(title: str, desc: str, query: Dataquery, *, w: int = 12, h: int = 8) -> heatmap.Panel:
    """A heatmap whose rows are given series (quantiles or ranks), not calculated buckets."""
    return (
        heatmap.Panel()
        .title(title)
        .description(desc)
        .datasource(DS)
        .targets(_refs((query,)))
        .span(w)
        .height(h)
        .calculate(False)
        .rows_frame(RowsHeatmapOptions().layout(HeatmapCellLayout.UNKNOWN).value("seconds"))
        .color(HeatmapColorOptions().mode(HeatmapColorMode.SCHEME).scheme("Oranges").steps(64))
        .y_axis(YAxisConfig().axis_label(desc.split(":")[0]))
        .unit("s")
    )


def merged_table(
    title: str, desc: str, *queries: Dataquery, rename: dict[str, str], w: int = 24, h: int = 8
) -> table.Panel:
    """Instant queries in table format, merged on their labels into one row per series."""
    order = {name: i for i, name in enumerate(rename)}
    return (
        table.Panel()
        .title(title)
        .description(desc)
        .datasource(DS)
        .targets(_refs(queries))
        .span(w)
        .height(h)
        .with_transformation(DataTransformerConfig(id_val="merge", options={}))
        .with_transformation(
            DataTransformerConfig(
                id_val="organize",
                options={"excludeByName": {"Time": True}, "indexByName": order, "renameByName": rename},
            )
        )
    )


def datasource_var(c: Config) -> DatasourceVariable:
    return (
        DatasourceVariable("datasource")
        .label("Data source")
        .type("prometheus")
        .current(VariableOption(selected=True, text="Prometheus (stepwatch)", value=c.datasource_uid))
    )


#: How far back the ``$run`` picker looks. /metrics drops a run an hour after its last
#: batch (``STEPWATCH_METRICS_RUN_EXPIRY_S``), so a picker bound to the dashboard's time
#: range (``label_values``) would lose a finished run while its data is still in Prometheus.
RUN_PICKER_LOOKBACK = "14d"


def run_var() -> QueryVariable:
    return (
        QueryVariable("run")
        .label("Run")
        .datasource(DS)
        .query(f"query_result(max by (run) (last_over_time(stepwatch_run_info[{RUN_PICKER_LOOKBACK}])))")
        .regex('/run="([^"]+)"/')
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
    )


def rank_var() -> QueryVariable:
    return (
        QueryVariable("rank")
        .label("Rank (flagged or slowest)")
        .datasource(DS)
        .query(f"label_values(stepwatch_rank_step_time_seconds{{{RUN}}}, rank)")
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.NATURAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(VariableOption(selected=True, text="All", value="$__all"))
    )


def target_var() -> TextBoxVariable:
    return (
        TextBoxVariable("target_tokens")
        .label("Target tokens")
        .description("Tokens the run is planned to process; the ETA and finish date use it.")
        .default_value("1e12")
        .current(VariableOption(selected=True, text="1e12", value="1e12"))
    )


def links() -> DashboardLink:
    return (
        DashboardLink("stepwatch")
        .type(DashboardLinkType.DASHBOARDS)
        .tags(["stepwatch"])
        .as_dropdown(True)
        .include_vars(True)
        .keep_time(True)
    )


def annotation(name: str, color: str, expr: str) -> AnnotationQuery:
    return AnnotationQuery().name(name).datasource(DS).enable(True).icon_color(color).expr(expr)


#: Fields of Prometheus annotations that the SDK's AnnotationQuery does not model.
ANNOTATION_FORMAT = {
    "Flags": {"titleFormat": "{{kind}} {{cause}}", "tagKeys": "kind,cause", "step": "60s"},
    "Alerts": {
        "titleFormat": "{{alertname}}",
        "textFormat": "{{severity}}",
        "tagKeys": "alertname",
        "step": "60s",
    },
}


def base(c: Config, uid: str, title: str, desc: str) -> Dashboard:
    return (
        Dashboard(title)
        .uid(uid)
        .description(desc)
        .tags(["stepwatch"])
        .readonly()
        .refresh("30s")
        .time("now-6h", "now")
        .timezone("browser")
        .link(links())
        .with_variable(datasource_var(c))
    )


# -- (a) run overview ----------------------------------------------------------------------


def run_overview(c: Config) -> Dashboard:
    n = Names.of(c)
    mfu = f"max by (run) (stepwatch_run_mfu_ratio{{{RUN}}})"
    done = f"max by (run) (stepwatch_run_tokens_total{{{RUN}}})"
    eta = f"clamp_min(($target_tokens - {done}) / on (run) {n.goodput}{{{RUN}}}, 0)"
    d = (
        base(
            c,
            "stepwatch-run",
            "stepwatch / Run overview",
            "Is the run as fast as it should be, and when will it finish?",
        )
        .with_variable(run_var())
        .with_variable(target_var())
        .annotation(
            annotation("Flags", "red", f"max by (run, kind, cause) (stepwatch_run_open_events{{{RUN}}}) > 0")
        )
        .annotation(annotation("Alerts", "orange", f'ALERTS{{alertstate="firing", {RUN}}}'))
        .with_row(Row("Now"))
        .with_panel(
            st("MFU", "Model FLOPs utilisation over the newest untagged steps.", "percentunit", q(mfu, "MFU"))
        )
        .with_panel(
            st(
                "MFU convention",
                "How the MFU was computed (FLOPs formula, dtype, device, peak source): MFUs are "
                "comparable only between runs with the same convention.",
                "none",
                q(f"max by (run, convention) (stepwatch_run_info{{{RUN}}})", "{{convention}}"),
                name=True,
            )
        )
        .with_panel(
            st(
                "Tokens/s",
                "Global non-padding tokens per second.",
                TOKENS_PER_S,
                q(f"max by (run) (stepwatch_run_tokens_per_second{{{RUN}}})", "tokens/s"),
            )
        )
        .with_panel(
            st(
                "Step time",
                "Mean step time over the newest untagged steps.",
                "s",
                q(f"max by (run) (stepwatch_run_step_time_seconds{{{RUN}}})", "step time"),
            )
        )
        .with_panel(
            st(
                "Ranks reporting / world size",
                "Ranks that reported one of the two newest windows, and the world size.",
                "none",
                q(f"max by (run) (stepwatch_run_reporting_ranks{{{RUN}}})", "reporting"),
                q(f"max by (run) (stepwatch_run_world_size_ranks{{{RUN}}})", "world size"),
            )
        )
        .with_panel(
            st(
                "Open flags",
                "Open straggler, regression and hang flags.",
                "none",
                q(f"sum by (run) (max by (run, kind, cause) (stepwatch_run_open_events{{{RUN}}}))", "open"),
            )
        )
        .with_row(Row("Progress"))
        .with_panel(st("Tokens done", "Global non-padding tokens processed.", TOKENS, q(done, "tokens")))
        .with_panel(
            st(
                "Steps done",
                "Newest optimizer step.",
                "none",
                q(f"max by (run) (stepwatch_run_steps_total{{{RUN}}})", "steps"),
            )
        )
        .with_panel(
            st(
                "Goodput",
                f"Tokens per wall-clock second over {c.goodput_window}, checkpoints, evaluation and "
                f"gaps included (low during a run's first {c.goodput_window}: rate() divides by the window).",
                TOKENS_PER_S,
                q(f"{n.goodput}{{{RUN}}}", "goodput"),
            )
        )
        .with_panel(
            st(
                "Calendar efficiency",
                "Share of wall time spent stepping (goodput / tokens per productive second).",
                "percentunit",
                q(f"{n.calendar_efficiency}{{{RUN}}}", "calendar efficiency"),
            )
        )
        .with_panel(
            st(
                "ETA to $target_tokens tokens",
                "Remaining tokens (to the dashboard's Target tokens) / goodput.",
                "s",
                q(eta, "ETA"),
            )
        )
        .with_panel(
            st(
                "Projected finish",
                "Now + ETA at the current goodput.",
                "dateTimeAsIso",
                q(f"1000 * (time() + {eta})", "finish"),
            )
        )
        .with_row(Row("Over time"))
        .with_panel(
            ts(
                "MFU and its baseline",
                "MFU of the newest untagged steps, and of the run's first steps after warm-up.",
                "percentunit",
                q(mfu, "MFU"),
                q(f"max by (run) (stepwatch_run_baseline_mfu_ratio{{{RUN}}})", "baseline"),
                lo=0,
            )
        )
        .with_panel(
            ts(
                "Tokens per second",
                "Instantaneous (productive) throughput and goodput (wall clock).",
                TOKENS_PER_S,
                q(f"max by (run) (stepwatch_run_tokens_per_second{{{RUN}}})", "tokens/s"),
                q(f"{n.goodput}{{{RUN}}}", "goodput"),
                lo=0,
            )
        )
        .with_panel(
            ts(
                "Step time",
                "Mean step time, its baseline, the slowest rank's step time and the data-loader wait.",
                "s",
                q(f"max by (run) (stepwatch_run_step_time_seconds{{{RUN}}})", "step time"),
                q(f"max by (run) (stepwatch_run_baseline_step_time_seconds{{{RUN}}})", "baseline"),
                q(
                    f'max by (run) (stepwatch_run_rank_step_time_seconds{{{RUN}, quantile="1.0"}})',
                    "slowest rank",
                ),
                q(f"max by (run) (stepwatch_run_data_wait_seconds{{{RUN}}})", "data wait"),
                lo=0,
            )
        )
        .with_panel(
            ts(
                "Against the baseline",
                f"MFU and step time over {c.window} divided by the baseline: the alerts fire below "
                f"{c.mfu_drop_below} and above {c.step_time_above}.",
                "none",
                q(f"{n.mfu_vs_baseline}{{{RUN}}}", "MFU / baseline"),
                q(f"{n.step_time_vs_baseline}{{{RUN}}}", "step time / baseline"),
            )
        )
        .with_panel(
            ts(
                "Since the last step",
                "Seconds since any rank last reported a step, and the hang threshold.",
                "s",
                q(f"{n.step_silence}{{{RUN}}}", "since last step"),
                q(f"max by (run) (stepwatch_run_hang_threshold_seconds{{{RUN}}})", "hang threshold"),
                lo=0,
            )
        )
        .with_panel(
            merged_table(
                "Firing alerts",
                "Alerts firing for this run.",
                q(f'ALERTS{{alertstate="firing", {RUN}}}', instant=True, table_=True),
                rename={"alertname": "alert", "severity": "severity", "rank": "rank", "Hostname": "host"},
                w=12,
            )
        )
    )
    return d


# -- (b) time breakdown --------------------------------------------------------------------


def breakdown(c: Config) -> Dashboard:
    n = Names.of(c)
    parts = f"max by (run, phase) (stepwatch_run_breakdown_seconds{{{RUN}}})"
    return (
        base(c, "stepwatch-breakdown", "stepwatch / Time breakdown", "Where does the step time go?")
        .with_variable(run_var())
        .with_panel(
            ts(
                "Where the step goes",
                "Seconds per step in compute only, communication overlapped with compute, exposed "
                "communication, data-loader wait and idle (mean over ranks, newest profiled window). "
                "They sum to the step time.",
                "s",
                q(parts, "{{phase}}"),
                stack=True,
                lo=0,
            )
        )
        .with_panel(
            ts(
                "Share of the step",
                "Each part as a share of the step.",
                "percentunit",
                q(f"{n.breakdown_share}{{{RUN}}}", "{{phase}}"),
                stack=True,
                lo=0,
                hi=1,
            )
        )
        .with_panel(
            ts(
                "Overlap ratio",
                "Communication hidden behind compute / all communication (1 = fully overlapped).",
                "percentunit",
                q(f"max by (run) (stepwatch_run_overlap_ratio{{{RUN}}})", "overlap"),
                lo=0,
                hi=1,
            )
        )
        .with_panel(
            bargauge.Panel()
            .title("Latest breakdown")
            .description("The parts of the step in the newest profiled window.")
            .datasource(DS)
            .unit("s")
            .targets(_refs((q(parts, "{{phase}}", instant=True),)))
            .reduce_options(ReduceDataOptions().calcs(["lastNotNull"]).values(False))
            .span(12)
            .height(8)
        )
        .with_panel(
            ts(
                "Data-loader wait share",
                f"Slowest-waiting rank's loader wait / step time over {c.window}; alert above "
                f"{c.data_wait_share_above:.0%}.",
                "percentunit",
                q(f"{n.data_wait_share}{{{RUN}}}", "data wait share"),
                lo=0,
            )
        )
        .with_panel(
            ts(
                "Step time and the sum of its parts",
                "The parts should add up to the step time; a gap means time the profiler did not see.",
                "s",
                q(f"max by (run) (stepwatch_run_step_time_seconds{{{RUN}}})", "step time"),
                q(f"sum by (run) ({parts})", "sum of parts"),
                lo=0,
            )
        )
    )


# -- (c) ranks -------------------------------------------------------------------------------


def ranks(c: Config) -> Dashboard:
    sel = f'{RUN}, rank=~"$rank"'

    def across(quantity: str) -> Dataquery:
        return q(f"max by (quantile) (stepwatch_run_rank_{quantity}_seconds{{{RUN}}})", "{{quantile}}")

    def per_rank(quantity: str) -> Dataquery:
        return q(f"max by (rank) (stepwatch_rank_{quantity}_seconds{{{sel}}})", "{{rank}}")

    flag = f"max by (rank, Hostname, gpu, cause) (stepwatch_straggler_{{}}{{{{{RUN}}}}})"
    return (
        base(c, "stepwatch-ranks", "stepwatch / Ranks", "Is one rank, host or link holding everyone back?")
        .with_variable(run_var())
        .with_variable(rank_var())
        .with_row(Row("Across all ranks (quantiles)"))
        .with_panel(
            heat(
                "Compute time across ranks",
                "Compute time: rows are quantiles across all ranks (0 = fastest, 1 = slowest), "
                "newest profiled window. A compute straggler shows as a hot top row.",
                across("compute"),
            )
        )
        .with_panel(
            heat(
                "Collective wait across ranks",
                "Collective wait: time spent waiting for the last peer; the straggler waits least, "
                "its victims most.",
                across("comm_wait"),
            )
        )
        .with_panel(
            heat(
                "Data wait across ranks",
                "Data wait: data-loader wait per step across ranks, newest complete window.",
                across("data_wait"),
            )
        )
        .with_panel(
            heat(
                "Step time across ranks",
                "Step time: per rank, newest complete window (equal in synchronous training).",
                across("step_time"),
            )
        )
        .with_row(Row("Flagged and slowest ranks"))
        .with_panel(
            merged_table(
                "Stragglers and their cost",
                "Open straggler flags: the cost is how much shorter each step would be if the rank "
                "ran at its peers' median.",
                q(flag.format("cost_seconds"), instant=True, table_=True),
                q(flag.format("cost_ratio"), instant=True, table_=True),
                q(flag.format("first_step"), instant=True, table_=True),
                rename={
                    "rank": "rank",
                    "Hostname": "host",
                    "gpu": "GPU",
                    "cause": "cause",
                    "Value #A": "cost (s/step)",
                    "Value #B": "cost (share of step)",
                    "Value #C": "since step",
                },
            )
        )
        .with_panel(
            heat(
                "Compute time per rank",
                "Compute time: rows are the flagged and top-K slowest ranks.",
                per_rank("compute"),
                w=8,
            )
        )
        .with_panel(
            heat(
                "Collective wait per rank",
                "Collective wait: flagged and slowest ranks.",
                per_rank("comm_wait"),
                w=8,
            )
        )
        .with_panel(
            heat("Data wait per rank", "Data wait: flagged and slowest ranks.", per_rank("data_wait"), w=8)
        )
        .with_panel(
            ts(
                "Selected ranks against the median",
                "Compute time of the selected ranks and the median over all ranks.",
                "s",
                per_rank("compute"),
                q(f'max by (run) (stepwatch_run_rank_compute_seconds{{{RUN}, quantile="0.5"}})', "median"),
                w=24,
            )
        )
    )


# -- (d) fleet -------------------------------------------------------------------------------


def fleet(c: Config) -> Dashboard:
    n = Names.of(c)

    def by_run(metric: str) -> str:
        return f"max by (run) ({metric})"

    return (
        base(c, "stepwatch-fleet", "stepwatch / Fleet", "All runs side by side.")
        .with_panel(
            st(
                "Runs reporting",
                "Runs that reported within the expiry, and runs exported (capped).",
                "none",
                q('max(stepwatch_metrics_runs{state="active"})', "active"),
                q('max(stepwatch_metrics_runs{state="exported"})', "exported"),
                w=8,
            )
        )
        .with_panel(
            st(
                "Tokens/s, all runs",
                "Sum over runs of global tokens per second.",
                TOKENS_PER_S,
                q(f"sum({by_run('stepwatch_run_tokens_per_second')})", "tokens/s"),
                w=8,
            )
        )
        .with_panel(
            st(
                "Open flags, all runs",
                "Open straggler, regression and hang flags over all runs.",
                "none",
                q("sum(max by (run, kind, cause) (stepwatch_run_open_events))", "open"),
                w=8,
            )
        )
        .with_panel(
            merged_table(
                "Runs",
                "One row per run: the newest values.",
                q(by_run("stepwatch_run_mfu_ratio"), instant=True, table_=True),
                q(by_run("stepwatch_run_tokens_per_second"), instant=True, table_=True),
                q(by_run("stepwatch_run_step_time_seconds"), instant=True, table_=True),
                q(by_run("stepwatch_run_reporting_ranks"), instant=True, table_=True),
                q(by_run("stepwatch_run_world_size_ranks"), instant=True, table_=True),
                q(
                    "sum by (run) (max by (run, kind, cause) (stepwatch_run_open_events))",
                    instant=True,
                    table_=True,
                ),
                q(n.report_age, instant=True, table_=True),
                rename={
                    "run": "run",
                    "Value #A": "MFU",
                    "Value #B": "tokens/s",
                    "Value #C": "step time (s)",
                    "Value #D": "ranks reporting",
                    "Value #E": "world size",
                    "Value #F": "open flags",
                    "Value #G": "last report (s ago)",
                },
            )
            .align(FieldTextAlignment.AUTO)  # what Grafana fills in anyway once the table has field config
            .inspect(False)
            .override_by_name(
                "run",
                [
                    DynamicConfigValue(
                        id_val="links",
                        value=[
                            {
                                "title": "Run overview of ${__value.raw}",
                                "url": "/d/stepwatch-run/?var-run=${__value.raw}&${__url_time_range}",
                            }
                        ],
                    )
                ],
            )
        )
        .with_panel(ts("MFU by run", "MFU of every run.", "percentunit", q(n.mfu, "{{run}}"), lo=0))
        .with_panel(
            ts(
                "Tokens/s by run",
                "Tokens per second of every run.",
                TOKENS_PER_S,
                q(n.tokens_per_s, "{{run}}"),
            )
        )
        .with_panel(
            ts(
                "Step time against baseline by run",
                "Step time over the window divided by each run's baseline.",
                "none",
                q(n.step_time_vs_baseline, "{{run}}"),
            )
        )
        .with_panel(
            ts(
                "Open flags by run",
                "Open straggler, regression and hang flags per run.",
                "none",
                q("sum by (run) (max by (run, kind, cause) (stepwatch_run_open_events))", "{{run}}"),
            )
        )
    )


BUILDERS = {
    "stepwatch-run": run_overview,
    "stepwatch-breakdown": breakdown,
    "stepwatch-ranks": ranks,
    "stepwatch-fleet": fleet,
}


def to_model(d: Dashboard) -> dict[str, Any]:
    """The dashboard as a JSON model (the SDK's encoding, plus annotation formats)."""
    model: dict[str, Any] = json.loads(JSONEncoder(sort_keys=True).encode(d.build()))
    for ann in model.get("annotations", {}).get("list", []):
        ann.update(ANNOTATION_FORMAT.get(ann.get("name", ""), {}))
    for i, panel in enumerate(model.get("panels", []), start=1):
        panel["id"] = i  # stable, unique ids: links and the "view panel" URL use them
    return model


def dashboards(c: Config = DEFAULT) -> dict[str, dict[str, Any]]:
    return {uid: to_model(build(c)) for uid, build in BUILDERS.items()}
