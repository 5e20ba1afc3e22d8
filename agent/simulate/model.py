"""Synthetic step timings of a synchronous data/tensor/pipeline-parallel job, with faults.

The one noise model of the project: the simulator sends it through the agent's path,
``stepwatch evaluate`` scores the detectors on it, and the detectors' unit tests read it
(``tests/synthetic.py``). Per rank and window of ``n`` steps:

- compute: a persistent per-rank speed spread (silicon, thermals; ``rank_spread``),
  lognormal per-step jitter (``step_jitter``, averaged over the window), random GC pauses
  (``gc_prob`` per step, ``gc_pause`` of a step's compute) and periodic ones (every
  ``gc_every`` steps at a per-rank phase), a slow AR(1) wander of the whole job's speed
  (``drift``), and a heavier last pipeline stage (``stage_skew``);
- data-loader wait per step: lognormal around a small mean plus rare multi-100-ms
  stalls (``stall_prob``, ``stall_s``);
- transfer per communicator group (lognormal ``transfer_jitter``), of which ``overlap`` is
  hidden behind compute;
- synchronous semantics: a rank waits in its data-parallel all-reduce for the slowest
  member, so a compute straggler shows long compute and short wait while its peers'
  waits grow, and every rank's step time is the job's;
- tagged steps: the first ``warmup_steps`` (slower), a checkpoint every
  ``checkpoint_every`` steps (``checkpoint_s`` longer; untagged with
  ``untagged_checkpoints``), optionally ``eval_steps`` of
  evaluation every ``eval_every`` steps (three times longer).

Faults (:mod:`.faults`) act from their window on. Everything is seeded.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from .faults import Fault
from .topology import Topology

#: Share of the nominal step time per component, and per communicator type of the transfer.
COMPUTE_SHARE = 0.86
DATA_SHARE = 0.002
TRANSFER_SHARE = {"dp": 0.125, "tp": 0.05, "cp": 0.025, "pp": 0.0125}
OVERHEAD_SHARE = 0.01


@dataclass(frozen=True)
class Noise:
    """Clean-run noise (see the module docstring); defaults as in the detectors' tuning."""

    step_jitter: float = 0.03
    rank_spread: float = 0.01
    gc_prob: float = 0.01
    gc_pause: float = 0.15
    gc_every: int = 200
    data_jitter: float = 0.3
    stall_prob: float = 0.003
    stall_s: tuple[float, float] = (0.1, 0.8)
    transfer_jitter: float = 0.05
    overlap: float = 0.6
    drift: float = 0.003
    stage_skew: float = 0.25
    warmup_steps: int = 20
    warmup_slowdown: float = 0.3
    checkpoint_every: int = 1000
    checkpoint_s: float = 30.0
    eval_every: int = 0
    eval_steps: int = 4
    #: Checkpoint steps carry no tag (a job that does not tag them): a few long steps.
    untagged_checkpoints: bool = False


@dataclass(frozen=True)
class RankTiming:
    """One rank's breakdown in one window: means per step, in seconds, as the agent
    measures them: ``compute_s`` is compute only (the overlapped communication is its own
    part), so compute, overlapped, exposed, data wait and idle sum to the step time.
    ``comm_wait_s``, ``comm_transfer_s`` and ``group_transfer_s`` are what the collector
    derives from the ranks' arrival times (:mod:`.entries`)."""

    compute_s: float
    data_wait_s: float
    comm_wait_s: float
    comm_transfer_s: float
    comm_exposed_s: float
    comm_overlapped_s: float
    idle_s: float
    group_transfer_s: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class WindowTimings:
    """Everything the ranks report for one window."""

    index: int
    first_step: int
    step_time_s: list[float]
    tags: list[str | None]
    data_wait_s: list[list[float]]
    ranks: list[RankTiming]
    silent: frozenset[int]

    @property
    def n_steps(self) -> int:
        return len(self.step_time_s)

    @property
    def last_step(self) -> int:
        return self.first_step + self.n_steps - 1


class TimingModel:
    """Seeded generator of :class:`WindowTimings` for a topology, noise and faults."""

    def __init__(
        self,
        topology: Topology,
        *,
        step_time_s: float = 2.0,
        steps_per_window: int = 16,
        mfu: float = 0.40,
        peak_flops: float = 989e12,
        flops_per_token: float = 6 * 7.0e9,
        faults: Sequence[Fault] = (),
        noise: Noise | None = None,
        seed: int = 0,
    ) -> None:
        if step_time_s <= 0 or steps_per_window < 1:
            raise ValueError("need step_time_s > 0 and steps_per_window >= 1")
        self.topology = topology
        self.step_time_s = step_time_s
        self.steps_per_window = steps_per_window
        self.peak_flops = peak_flops
        self.flops_per_token = flops_per_token
        self.faults = tuple(faults)
        self.noise = noise or Noise()
        self.seed = seed
        world = topology.world
        #: Real tokens per step for the whole job, so that MFU is about ``mfu``.
        self.tokens_per_replica = max(
            1, round(mfu * world * peak_flops * step_time_s / flops_per_token / topology.dp)
        )

    @property
    def tokens_per_step(self) -> int:
        return self.tokens_per_replica * self.topology.dp

    @property
    def convention(self) -> dict[str, Any]:
        """The FLOPs convention the simulated agents report (explicit, a datasheet-like peak)."""
        peak_tf = self.peak_flops / 1e12
        return {
            "formula": "explicit",
            "attention": None,
            "flops_per_token": self.flops_per_token,
            "hfu_flops_per_token": None,
            "dtype": "bf16",
            "device_name": "simulated",
            "peak_flops": self.peak_flops,
            "peak_source": "simulator",
            "id": f"explicit/bf16/simulated@{peak_tf:g}TFLOPs[simulator]",
        }

    @property
    def hang_at(self) -> int | None:
        """First window no rank reports (a ``hang`` fault), if any."""
        hangs = [f.at for f in self.faults if f.kind == "hang"]
        return min(hangs) if hangs else None

    def windows(self, n_windows: int) -> Iterator[WindowTimings]:
        """Windows ``0 .. n_windows - 1``, stopping early at a hang."""
        topo, nz = self.topology, self.noise
        rng = random.Random(self.seed)
        n = self.steps_per_window
        world = topo.world
        # The slowest pipeline stage sets the pace: scale compute so the step is about step_time_s.
        compute = COMPUTE_SHARE * self.step_time_s / (1.0 + (nz.stage_skew if topo.pp > 1 else 0.0))
        data = DATA_SHARE * self.step_time_s
        overhead = OVERHEAD_SHARE * self.step_time_s
        speed = [math.exp(rng.gauss(0.0, nz.rank_spread)) for _ in range(world)]
        gc_phase = [rng.randrange(max(1, nz.gc_every)) for _ in range(world)]
        last_stage = topo.pp - 1
        stage = [
            1.0 + (nz.stage_skew if topo.pp > 1 and topo.coords[r]["pp"] == last_stage else 0.0)
            for r in range(world)
        ]
        jitter = nz.step_jitter / math.sqrt(n)
        rho = 0.99
        level = 0.0
        hang = self.hang_at

        for w in range(n_windows):
            if hang is not None and w >= hang:
                return
            first = w * n + 1
            active = [f for f in self.faults if f.active(w)]
            slow_c = [1.0] * world
            extra_d = [0.0] * world
            slow_link = [1.0] * world
            silent: set[int] = set()
            drop: dict[str, float] = {}
            for f in active:
                if f.kind == "compute":
                    slow_c[f.target] *= 1.0 + f.mag
                elif f.kind == "host":
                    for r in range(f.target * topo.ranks_per_host, (f.target + 1) * topo.ranks_per_host):
                        slow_c[r] *= 1.0 + f.mag
                elif f.kind == "data":
                    extra_d[f.target] += f.mag
                elif f.kind == "link":
                    slow_link[f.target] *= 1.0 + f.mag
                elif f.kind == "silent":
                    silent.add(f.target)
                elif f.kind == "mfu":
                    drop[f.component] = 1.0 - (1.0 - drop.get(f.component, 0.0)) * (1.0 - f.mag)

            level = rho * level + rng.gauss(0.0, nz.drift * math.sqrt(1.0 - rho * rho))
            job_speed = math.exp(level)
            comp: list[float] = []
            waits_per_step: list[list[float]] = []
            data_mean: list[float] = []
            for r in range(world):
                c = compute * stage[r] * speed[r] * job_speed * math.exp(rng.gauss(0.0, jitter))
                pauses = sum(1 for _ in range(n) if rng.random() < nz.gc_prob)
                if nz.gc_every > 0:
                    pauses += sum(1 for s in range(first, first + n) if (s + gc_phase[r]) % nz.gc_every == 0)
                c += pauses * nz.gc_pause * compute / n
                c = c * slow_c[r]
                comp.append(c)
                per_step = []
                for _ in range(n):
                    d = data * math.exp(rng.gauss(0.0, nz.data_jitter))
                    if rng.random() < nz.stall_prob:
                        d += rng.uniform(*nz.stall_s)
                    per_step.append(d + extra_d[r])
                waits_per_step.append(per_step)
                data_mean.append(sum(per_step) / n)

            per_group: list[dict[str, float]] = [{} for _ in range(world)]
            if topo.group_types:
                for (gtype, _gid), members in sorted(topo.groups.items()):
                    t = (
                        TRANSFER_SHARE[gtype]
                        * self.step_time_s
                        * math.exp(rng.gauss(0.0, nz.transfer_jitter))
                    )
                    t *= max(slow_link[r] for r in members)
                    for r in members:
                        per_group[r][gtype] = t
                transfer = [sum(g.values()) for g in per_group]
            else:
                base_t = TRANSFER_SHARE["dp"] * self.step_time_s
                transfer = [
                    base_t * math.exp(rng.gauss(0.0, nz.transfer_jitter)) * slow_link[r] for r in range(world)
                ]

            wait = [0.0] * world
            for members in topo.dp_groups.values():
                slowest = max(comp[r] + data_mean[r] for r in members)
                for r in members:
                    wait[r] = max(0.0, slowest - comp[r] - data_mean[r])
            exposed = [wait[r] + transfer[r] * (1.0 - nz.overlap) for r in range(world)]
            if topo.group_types:
                # What the profiler measures: every collective of the rank waits for the last
                # member of its group (arrival = compute + loader wait, as in :mod:`.entries`).
                arrive = [comp[r] + data_mean[r] for r in range(world)]
                wait = [0.0] * world
                for members in topo.groups.values():
                    last_in = max(arrive[r] for r in members)
                    for r in members:
                        wait[r] += last_in - arrive[r]
            step = max(comp[r] + data_mean[r] + exposed[r] for r in range(world)) + overhead
            for component, fraction in drop.items():
                # The whole job slows: this component grows on every rank by what makes
                # the step 1 / (1 - fraction) longer, i.e. MFU falls by ``fraction``.
                added = step * (1.0 / (1.0 - fraction) - 1.0)
                step += added
                for r in range(world):
                    if component == "compute_s":
                        comp[r] += added
                    elif component == "comm_exposed_s":
                        exposed[r] += added
                    elif component == "data_wait_s":
                        data_mean[r] += added
                        waits_per_step[r] = [d + added for d in waits_per_step[r]]

            ranks = [
                RankTiming(
                    compute_s=max(0.0, comp[r] - transfer[r] * nz.overlap),
                    data_wait_s=data_mean[r],
                    comm_wait_s=wait[r],
                    comm_transfer_s=transfer[r],
                    comm_exposed_s=exposed[r],
                    comm_overlapped_s=transfer[r] * nz.overlap,
                    idle_s=max(0.0, step - comp[r] - data_mean[r] - exposed[r]),
                    group_transfer_s=per_group[r],
                )
                for r in range(world)
            ]
            times, tags = self._steps(rng, first, step)
            yield WindowTimings(
                index=w,
                first_step=first,
                step_time_s=times,
                tags=tags,
                data_wait_s=waits_per_step,
                ranks=ranks,
                silent=frozenset(silent),
            )

    def _steps(self, rng: random.Random, first: int, step: float) -> tuple[list[float], list[str | None]]:
        """Per-step job step times (mean ``step`` over the window, before tags) and tags."""
        nz = self.noise
        n = self.steps_per_window
        factors = [math.exp(rng.gauss(0.0, nz.step_jitter)) for _ in range(n)]
        scale = n / sum(factors)
        times: list[float] = []
        tags: list[str | None] = []
        for j in range(n):
            s = first + j
            t = step * factors[j] * scale
            tag: str | None = None
            if s <= nz.warmup_steps:
                t *= 1.0 + nz.warmup_slowdown * (1.0 - (s - 1) / max(1, nz.warmup_steps))
                tag = "warmup"
            elif nz.eval_every > 0 and (s - 1) % nz.eval_every >= nz.eval_every - nz.eval_steps:
                t *= 3.0
                tag = "eval"
            elif nz.checkpoint_every > 0 and s % nz.checkpoint_every == 0:
                t += nz.checkpoint_s
                tag = None if nz.untagged_checkpoints else "checkpoint"
            times.append(t)
            tags.append(tag)
        return times, tags
