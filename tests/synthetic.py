"""Seeded rank windows for the detectors' unit tests: the simulator's timing model, as
storage hands it to the analysis.

One noise model serves the simulator, ``stepwatch evaluate`` and these tests
(:class:`stepwatch.simulate.TimingModel`); this module only picks the tests' defaults
(8 hosts x 8 ranks, windows of 20 steps of 2 s) and converts each window with the
evaluation's :func:`~stepwatch_server.evaluation.paths.to_rank_windows`, the same
conversion the evaluation's direct path uses. Faults are :class:`stepwatch.simulate.Fault`.

:func:`job_series` is the regression detector's input: job-level window samples with
tagged warm-up, checkpoint and eval samples and a slow drift, placed exactly where the
tests want them (a tagged sample is added, not put in place of a window, so "windows
after the change" is plain arithmetic). It is a job-level model kept apart for that
control, with the simulator's noise parameters (:class:`stepwatch.simulate.Noise`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Literal

from stepwatch.simulate import Fault, Noise, TimingModel, Topology
from stepwatch_server.analysis.types import JobStep, RankWindow
from stepwatch_server.evaluation.paths import to_rank_windows

__all__ = ["Fault", "Noise", "Topology", "job_series", "rank_windows"]

STEPS_PER_WINDOW = 20


def rank_windows(
    *,
    topology: Topology | None = None,
    n_windows: int,
    faults: Sequence[Fault] = (),
    noise: Noise | None = None,
    profiler_every: int = 1,
    seed: int = 0,
    run: str = "synthetic",
) -> Iterator[list[RankWindow]]:
    """One list of rank windows (ordered by rank) per window index; windows that are not a
    multiple of ``profiler_every`` carry no profiler fields, as when the profiler skipped them."""
    model = TimingModel(
        topology or Topology(hosts=8, ranks_per_host=8),
        steps_per_window=STEPS_PER_WINDOW,
        faults=faults,
        noise=noise,
        seed=seed,
    )
    for wt in model.windows(n_windows):
        windows = to_rank_windows(run, model, wt)
        if wt.index % profiler_every:
            windows = [
                replace(
                    w,
                    compute_s=None,
                    comm_exposed_s=None,
                    comm_overlapped_s=None,
                    idle_s=None,
                    comm_wait_s=None,
                    comm_transfer_s=None,
                    group_transfer_s={},
                )
                for w in windows
            ]
        yield windows


def _count(rng: random.Random, n: int, p: float) -> int:
    return sum(1 for _ in range(n) if rng.random() < p)


def job_series(
    *,
    n_windows: int,
    steps_per_window: int = 20,
    step_time_s: float = 2.0,
    mfu: float = 0.42,
    tokens_per_step: float = 4_194_304.0,
    warmup_windows: int = 10,
    checkpoint_every: int = 50,
    eval_every: int = 100,
    eval_windows: int = 2,
    drift: float = 0.003,
    noise: Noise | None = None,
    drop_at: int | None = None,
    drop: float = 0.05,
    drop_component: str = "comm_exposed_s",
    seed: int = 0,
) -> list[JobStep]:
    """A job-level series of window samples, with tagged warm-up, checkpoint and eval samples.

    After window ``drop_at`` the time of ``drop_component`` grows so that MFU falls by
    ``drop`` (a fraction). ``drift`` is the stationary sigma of a slow AR(1) wander of the
    whole job's speed (log scale), the kind of slow change a detector must not call a
    regression.
    """
    nz = noise or Noise()
    rng = random.Random(seed)
    n = steps_per_window
    base = {
        "compute_s": 0.72 * step_time_s,
        "comm_exposed_s": 0.18 * step_time_s,
        "data_wait_s": 0.02 * step_time_s,
        "idle_s": 0.08 * step_time_s,
    }
    rho = 0.99
    level = 0.0
    step = 0
    out: list[JobStep] = []

    def sample(parts: dict[str, float], tag: Literal["warmup", "checkpoint", "eval"] | None, k: int) -> None:
        nonlocal step
        step += k
        total = sum(parts.values())
        out.append(
            JobStep(
                step=step,
                step_time_s=total,
                tokens=tokens_per_step * k,
                mfu=mfu * step_time_s / total,
                tag=tag,
                n_steps=k,
                compute_s=parts["compute_s"],
                comm_exposed_s=parts["comm_exposed_s"],
                comm_overlapped_s=0.1 * step_time_s,
                data_wait_s=parts["data_wait_s"],
                idle_s=parts["idle_s"],
            )
        )

    for w in range(n_windows):
        level = rho * level + rng.gauss(0.0, drift * math.sqrt(1.0 - rho * rho))
        speed = math.exp(level + rng.gauss(0.0, nz.step_jitter / math.sqrt(n)))
        parts = {
            "compute_s": base["compute_s"] * speed,
            "comm_exposed_s": base["comm_exposed_s"] * speed,
            "data_wait_s": base["data_wait_s"] * math.exp(rng.gauss(0.0, 0.1)),
            "idle_s": base["idle_s"],
        }
        parts["idle_s"] += _count(rng, n, nz.gc_prob) * nz.gc_pause * base["compute_s"] / n
        parts["data_wait_s"] += (
            sum(rng.uniform(*nz.stall_s) for _ in range(_count(rng, n, nz.stall_prob))) / n
        )
        if drop_at is not None and w >= drop_at:
            parts[drop_component] += step_time_s * (1.0 / (1.0 - drop) - 1.0)
        if w < warmup_windows:
            ramp = 1.0 + 0.5 * (warmup_windows - w) / warmup_windows
            sample({k: v * ramp for k, v in parts.items()}, "warmup", n)
            continue
        sample(parts, None, n)
        if checkpoint_every and w % checkpoint_every == checkpoint_every - 1:
            sample({**base, "idle_s": base["idle_s"] + nz.checkpoint_s}, "checkpoint", 1)
        if eval_every and w % eval_every == eval_every - 1:
            for _ in range(eval_windows):
                sample({k: 3.0 * v for k, v in base.items()}, "eval", n)
    return out
