"""The one configuration behind the rules and the dashboards (mixin style).

Change a threshold or a duration here, run ``python -m dashboards.generate``, and the
alert rules, their runbook links and the dashboards change together.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Config:
    #: Selects the collector's scrape job in every rule (the compose file's job name).
    job: str = "stepwatch"
    #: The Prometheus data source that Grafana provisioning creates.
    datasource_uid: str = "stepwatch-prometheus"
    #: Each alert links to its section of the runbook (``#<alert name in lower case>``).
    runbook_url: str = "https://github.com/stepwatch/stepwatch/blob/main/dashboards/RUNBOOK.md"
    #: Window of the smoothed run values that the alerts compare.
    window: str = "10m"
    #: Window of the wall-clock (goodput) token rate, which includes checkpoints and gaps.
    goodput_window: str = "1h"
    #: A warm-up, checkpoint or eval step within this window masks performance alerts.
    mask_window: str = "10m"
    #: MFU below this share of the run's baseline is a drop.
    mfu_drop_below: float = 0.90
    #: Step time above this multiple of the baseline is a regression.
    step_time_above: float = 1.10
    #: Data-loader wait above this share of the step time.
    data_wait_share_above: float = 0.10
    #: A straggler that costs less than this share of the step time does not page.
    straggler_cost_above: float = 0.01
    #: No batch from a run for this long: it stopped reporting.
    stopped_reporting_s: int = 300
    #: How long each condition must hold before its alert fires.
    for_: dict[str, str] = field(
        default_factory=lambda: {
            "StepwatchMFUDrop": "15m",
            "StepwatchStepTimeRegression": "15m",
            "StepwatchDataWaitHigh": "15m",
            "StepwatchStragglerPersisting": "10m",
            "StepwatchRegressionFlagged": "1m",
            "StepwatchRunHung": "1m",
            "StepwatchRunStoppedReporting": "5m",
            "StepwatchCollectorDown": "2m",
        }
    )

    @property
    def sel(self) -> str:
        return f'job="{self.job}"'

    def runbook(self, alert: str) -> str:
        return f"{self.runbook_url}#{alert.lower()}"


DEFAULT = Config()
