"""The collector's analysis: pure functions and small online detectors over plain data.

Nothing here imports the database, the web framework or the agent, so every detector can
be fed from the ingest path, the simulator or a test, and property-tested.

- :mod:`.types`: the input and output dataclasses (``RankWindow``, ``JobStep``, ``Finding``).
- :mod:`.robust`: median, MAD and the floored robust z-score.
- :mod:`.peers` / :mod:`.stragglers`: per-window straggler evidence, then persistence and
  hysteresis (``StragglerDetector``).
- :mod:`.baseline` / :mod:`.regressions` / :mod:`.attribution` / :mod:`.compare`: a run's
  frozen baseline, CUSUM regressions of MFU and step time, the part of the step that
  moved, and comparison with a named baseline run.
- :mod:`.hangs`: ``check_hang``; :mod:`.stuck_collectives`: which collective a stopped run
  is stuck in, who never entered it and who waits in it.
- :mod:`.progress`: tokens done, calendar efficiency, projected finish, required step time.
- :mod:`.efficiency`: static pipeline-stage imbalance.
- :mod:`.pipeline`: one run's analysis window by window (both detectors, the progress
  tally, JSON state), shared by the collector's worker and the evaluation.
"""

from __future__ import annotations

from .baseline import Baseline, FingerprintMismatchError
from .compare import RunComparison, compare_runs
from .efficiency import StageImbalance, stage_imbalance
from .hangs import check_hang, hang_threshold_s
from .peers import Hit, StragglerConfig, WindowVerdict, evaluate_window
from .progress import (
    Projection,
    ThroughputWindow,
    calendar_efficiency,
    duration_s,
    project,
    required_step_time_s,
)
from .regressions import RegressionConfig, RegressionDetector, build_baseline
from .robust import RobustStats, robust_stats
from .stragglers import StragglerDetector
from .stuck_collectives import GroupCounters, StuckCollective, stuck_collectives
from .types import EXCLUDED_TAGS, Cause, Finding, JobStep, Kind, RankWindow, Status, StepTag

__all__ = [
    "EXCLUDED_TAGS",
    "Baseline",
    "Cause",
    "Finding",
    "FingerprintMismatchError",
    "GroupCounters",
    "Hit",
    "JobStep",
    "Kind",
    "Projection",
    "RankWindow",
    "RegressionConfig",
    "RegressionDetector",
    "RobustStats",
    "RunComparison",
    "StageImbalance",
    "Status",
    "StepTag",
    "StragglerConfig",
    "StragglerDetector",
    "StuckCollective",
    "ThroughputWindow",
    "WindowVerdict",
    "build_baseline",
    "calendar_efficiency",
    "check_hang",
    "compare_runs",
    "duration_s",
    "evaluate_window",
    "hang_threshold_s",
    "project",
    "required_step_time_s",
    "robust_stats",
    "stage_imbalance",
    "stuck_collectives",
]
