"""Seeded synthetic rank windows and job series with realistic noise and injected faults.

For testing and tuning the detectors without a cluster: the unit tests use it, and the
defaults of :mod:`.peers` and :mod:`.regressions` were chosen with it. The load simulator,
which drives the real agent code path, is a separate tool; this module only produces the
plain data the analysis consumes.

The noise model, per rank and window of ``n`` steps: a persistent per-rank speed spread
(silicon and thermal variance), lognormal per-step compute jitter (averaged over the
window), GC pauses (a share of a step's compute, with a small probability per step),
lognormal data-loader wait with rare multi-100-ms stalls, lognormal transfer jitter per
communicator group, and periodic checkpoint pauses that stall every rank together.
Synchronous semantics: a rank waits in its data-parallel collective for the slowest
member of its group, so a compute straggler shows long compute and short wait while its
peers' waits grow; every rank's step time is the job's.

Faults: ``compute`` slows one rank's compute by a factor; ``host`` does that to every
rank of one host; ``data`` adds loader wait to one rank; ``link`` lengthens the transfer of
every communicator group the rank belongs to (with a layout), or of the rank itself in
pure data parallel (an agent timing its own sends).
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from .types import JobStep, RankWindow, StepTag

FaultCause = Literal["compute", "data", "link", "host"]


@dataclass(frozen=True, slots=True)
class Layout:
    """Hosts x ranks per host, split Megatron-style: tensor rank fastest, stage slowest."""

    hosts: int = 8
    ranks_per_host: int = 8
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        if self.world % (self.tp * self.pp):
            raise ValueError("world size must be a multiple of tp * pp")

    @property
    def world(self) -> int:
        """Number of ranks."""
        return self.hosts * self.ranks_per_host

    @property
    def dp(self) -> int:
        """Data-parallel degree."""
        return self.world // (self.tp * self.pp)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(dp_rank, tp_rank, pp_rank)`` of a rank."""
        return (rank // self.tp) % self.dp, rank % self.tp, rank // (self.tp * self.dp)

    def host(self, rank: int) -> str:
        """Host name of a rank."""
        return f"n{rank // self.ranks_per_host}"

    def groups(self, rank: int) -> dict[str, str]:
        """Communicator group ids of a rank; empty in pure data parallel."""
        if self.tp == 1 and self.pp == 1:
            return {}
        d, t, p = self.coords(rank)
        out = {}
        if self.dp > 1:
            out["dp"] = f"dp:tp{t}:pp{p}"
        if self.tp > 1:
            out["tp"] = f"tp:dp{d}:pp{p}"
        if self.pp > 1:
            out["pp"] = f"pp:dp{d}:tp{t}"
        return out


@dataclass(frozen=True, slots=True)
class Fault:
    """An injected fault from ``start_window`` (to ``end_window``, exclusive, if given).

    ``target`` is a rank, or a host index for ``host``. ``magnitude``: for ``compute`` and
    ``host`` the fractional compute slowdown (0.2 = 20% longer); for ``data`` extra loader
    wait in seconds per step; for ``link`` the fractional transfer slowdown.
    """

    cause: FaultCause
    target: int
    start_window: int
    magnitude: float
    end_window: int | None = None

    def active(self, window: int) -> bool:
        """Whether the fault is injected in ``window``."""
        return window >= self.start_window and (self.end_window is None or window < self.end_window)


@dataclass(frozen=True, slots=True)
class Noise:
    """Noise parameters (per step unless stated)."""

    step_jitter: float = 0.03
    rank_spread: float = 0.01
    gc_prob: float = 0.01
    gc_pause: float = 0.15
    data_jitter: float = 0.3
    stall_prob: float = 0.003
    stall_s: tuple[float, float] = (0.1, 0.8)
    transfer_jitter: float = 0.05
    overlap: float = 0.6
    checkpoint_every: int = 50
    checkpoint_s: float = 30.0
    stage_skew: float = 0.25


def _count(rng: random.Random, n: int, p: float) -> int:
    return sum(1 for _ in range(n) if rng.random() < p)


def rank_windows(
    *,
    layout: Layout | None = None,
    n_windows: int,
    steps_per_window: int = 20,
    compute_s: float = 1.6,
    data_wait_s: float = 0.004,
    transfer_s: float = 0.25,
    faults: Sequence[Fault] = (),
    noise: Noise | None = None,
    profiler_every: int = 1,
    seed: int = 0,
    run: str = "synthetic",
) -> Iterator[list[RankWindow]]:
    """Yield one list of rank windows per window index (see the module docstring)."""
    lay = layout or Layout()
    nz = noise or Noise()
    rng = random.Random(seed)
    n = steps_per_window
    ranks = range(lay.world)
    speed = [math.exp(rng.gauss(0.0, nz.rank_spread)) for _ in ranks]
    coords = [lay.coords(r) for r in ranks]
    groups = [lay.groups(r) for r in ranks]
    type_base = {"dp": transfer_s, "tp": 0.4 * transfer_s, "pp": 0.1 * transfer_s}
    jitter = nz.step_jitter / math.sqrt(n)

    for w in range(n_windows):
        active = [f for f in faults if f.active(w)]
        slow_c: dict[int, float] = defaultdict(lambda: 1.0)
        extra_d: dict[int, float] = defaultdict(float)
        slow_link: dict[int, float] = defaultdict(lambda: 1.0)
        for f in active:
            if f.cause == "compute":
                slow_c[f.target] *= 1.0 + f.magnitude
            elif f.cause == "host":
                for r in range(f.target * lay.ranks_per_host, (f.target + 1) * lay.ranks_per_host):
                    slow_c[r] *= 1.0 + f.magnitude
            elif f.cause == "data":
                extra_d[f.target] += f.magnitude
            else:
                slow_link[f.target] *= 1.0 + f.magnitude

        comp: list[float] = []
        data: list[float] = []
        for r in ranks:
            _, _, p = coords[r]
            stage = 1.0 + (nz.stage_skew if lay.pp > 1 and p == lay.pp - 1 else 0.0)
            c = compute_s * stage * speed[r] * math.exp(rng.gauss(0.0, jitter))
            c += _count(rng, n, nz.gc_prob) * nz.gc_pause * compute_s / n
            comp.append(c * slow_c[r])
            d = data_wait_s * math.exp(rng.gauss(0.0, nz.data_jitter))
            d += sum(rng.uniform(*nz.stall_s) for _ in range(_count(rng, n, nz.stall_prob))) / n
            data.append(d + extra_d[r])

        transfer: list[float] = []
        per_group: list[dict[str, float]] = [{} for _ in ranks]
        if groups[0]:
            members: dict[tuple[str, str], list[int]] = defaultdict(list)
            for r in ranks:
                for gtype, gid in groups[r].items():
                    members[(gtype, gid)].append(r)
            for (gtype, _gid), rs in sorted(members.items()):
                t = type_base[gtype] * math.exp(rng.gauss(0.0, nz.transfer_jitter))
                t *= max(slow_link[r] for r in rs)
                for r in rs:
                    per_group[r][gtype] = t
            transfer = [sum(per_group[r].values()) for r in ranks]
        else:
            transfer = [
                transfer_s * math.exp(rng.gauss(0.0, nz.transfer_jitter)) * slow_link[r] for r in ranks
            ]

        # The data-parallel collective waits for the slowest member of the group.
        dp_max: dict[tuple[int, int], float] = defaultdict(float)
        for r in ranks:
            key = (coords[r][1], coords[r][2])
            dp_max[key] = max(dp_max[key], comp[r] + data[r])
        wait = [max(0.0, dp_max[(coords[r][1], coords[r][2])] - comp[r] - data[r]) for r in ranks]
        exposed = [wait[r] + transfer[r] * (1.0 - nz.overlap) for r in ranks]
        step = max(comp[r] + data[r] + exposed[r] for r in ranks) + 0.02
        if nz.checkpoint_every and w % nz.checkpoint_every == nz.checkpoint_every - 1:
            step += nz.checkpoint_s / n
        profiled = w % profiler_every == 0

        out = []
        for r in ranks:
            d_r, t_r, p_r = coords[r]
            out.append(
                RankWindow(
                    run=run,
                    rank=r,
                    host=lay.host(r),
                    local_rank=r % lay.ranks_per_host,
                    window=w,
                    first_step=w * n + 1,
                    last_step=(w + 1) * n,
                    n_steps=n,
                    step_time_s=step,
                    data_wait_s=data[r],
                    compute_s=comp[r] if profiled else None,
                    comm_exposed_s=exposed[r] if profiled else None,
                    comm_overlapped_s=transfer[r] * nz.overlap if profiled else None,
                    idle_s=max(0.0, step - comp[r] - data[r] - exposed[r]) if profiled else None,
                    comm_wait_s=wait[r] if profiled else None,
                    comm_transfer_s=transfer[r] if profiled else None,
                    dp_rank=d_r if groups[r] else None,
                    tp_rank=t_r if groups[r] else None,
                    pp_rank=p_r if groups[r] else None,
                    groups=groups[r],
                    group_transfer_s=per_group[r] if profiled else {},
                )
            )
        yield out


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

    def sample(parts: dict[str, float], tag: StepTag | None, k: int) -> None:
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
