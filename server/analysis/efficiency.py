"""Static pipeline-stage imbalance: an efficiency finding, never a straggler.

Pipeline stages differ by design (the first holds the embedding, the last the head and
the loss), so a stage that is uniformly slower is not a faulty rank: the straggler
detector compares ranks only within their stage. The imbalance is still time lost, because
every stage waits for the slowest one; this module reports it per window so the run page
can show "stage 3 computes 22% longer than the median stage".
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from . import _format as fmt
from .robust import median
from .types import RankWindow


@dataclass(frozen=True, slots=True)
class StageImbalance:
    """Median compute time per stage and what the slowest stage costs.

    ``ratio`` compares the slowest stage with the median of the other stages.
    ``cost_seconds`` is the slowest stage's compute minus the mean stage compute per step:
    a lower bound of what balancing the stages would save (the pipeline schedule scales it
    up by ``(microbatches + stages - 1) / microbatches``).
    """

    stage_compute_s: Mapping[int, float]
    slowest_stage: int
    ratio: float
    cost_seconds: float
    cost_ratio: float
    message: str


def stage_imbalance(windows: Sequence[RankWindow], *, min_ratio: float = 1.05) -> StageImbalance | None:
    """The stage imbalance of one window, or ``None`` (no stages, no compute data, or balanced).

    A stage's work is its whole compute time: the agent's ``compute_s`` is compute only, and
    the communication overlapped with compute (``comm_overlapped_s``) is compute time too.
    """
    per_stage: dict[int, list[float]] = defaultdict(list)
    for w in windows:
        if w.pp_rank is not None and w.compute_s is not None:
            per_stage[w.pp_rank].append(w.compute_s + (w.comm_overlapped_s or 0.0))
    if len(per_stage) < 2:
        return None
    medians = {stage: median(values) for stage, values in sorted(per_stage.items())}
    slowest = max(medians, key=lambda s: medians[s])
    typical = median([v for s, v in medians.items() if s != slowest])
    mean = sum(medians.values()) / len(medians)
    ratio = medians[slowest] / typical if typical > 0 else 1.0
    if ratio < min_ratio:
        return None
    step = median([w.step_time_s for w in windows])
    cost = max(0.0, medians[slowest] - mean)
    cost_ratio = cost / step if step > 0 else 0.0
    return StageImbalance(
        stage_compute_s=medians,
        slowest_stage=slowest,
        ratio=ratio,
        cost_seconds=cost,
        cost_ratio=cost_ratio,
        message=(
            f"Pipeline stage {slowest} computes {fmt.pct(ratio - 1.0)} longer than the other stages' median "
            f"({fmt.secs(medians[slowest])} vs {fmt.secs(typical)}); balancing the stages would save "
            f"at least {fmt.secs(cost)}/step ({fmt.pct(cost_ratio)})."
        ),
    )
