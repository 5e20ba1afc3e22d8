"""The evaluation's scenarios: one injected fault each (or none), and what should be flagged.

Fault scenarios follow the issue's list (slow compute rank, slow link in one group,
loader stall, slow host, MFU drop at step S, hang) plus a rank whose agent goes silent;
each runs in pure data parallel and, where the layout matters, in a 3-D layout (tensor 4
x pipeline 2) whose peer groups and communicator groups the detectors must respect.
Clean scenarios carry the simulator's full noise (jitter, GC pauses, loader stalls,
checkpoints, evaluation passes, warm-up, a heavier last pipeline stage) and must raise
nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from stepwatch.simulate import Fault, Noise, Topology

DP = Topology(hosts=4, ranks_per_host=8)
DP_FAST = Topology(hosts=4, ranks_per_host=4)
SMALL = Topology(hosts=2, ranks_per_host=8)
ONE_HOST = Topology(hosts=1, ranks_per_host=8)
THREE_D = Topology(hosts=8, ranks_per_host=8, tp=4, pp=2)

#: Goals of the issue: windows to open a straggler flag, to find a 5% MFU drop, to find a
#: sustained job-wide change of 10% in step time (after the baseline formed).
STRAGGLER_GOAL_WINDOWS = 3
MFU_GOAL_WINDOWS = 10
REGRESSION_GOAL_WINDOWS = 5
#: A job-wide fault of this MFU drop makes every step 10% longer: 1 / (1 - 1/11) = 1.1.
PLUS_TEN_PERCENT = 1.0 / 11.0


@dataclass(frozen=True)
class Expectation:
    """The flag a scenario must raise (``key``), with its cause and ranks."""

    key: str
    kind: str
    cause: str | None = None
    ranks: tuple[int, ...] = ()
    hosts: tuple[str, ...] = ()
    component: str | None = None
    goal_windows: int | None = None
    #: Other flags that are consequences of the fault, not false flags (a slow rank
    #: slows the whole job, which the regression detector may rightly report).
    related: tuple[str, ...] = ("regression:mfu", "regression:step_time")


@dataclass(frozen=True)
class Scenario:
    """A simulated run: layout, length, faults, and the expected flag (None: clean)."""

    name: str
    topology: Topology
    windows: int
    faults: tuple[Fault, ...] = ()
    expect: Expectation | None = None
    steps_per_window: int = 16
    step_time_s: float = 2.0
    noise: Noise = field(default_factory=Noise)
    realtime: bool = False

    @property
    def fault(self) -> Fault | None:
        return self.faults[0] if self.faults else None

    @property
    def rank_windows(self) -> int:
        return self.topology.world * self.windows

    def label(self) -> str:
        t = self.topology
        shape = f"{t.world} ranks" + (f" tp{t.tp} pp{t.pp}" if t.model_parallel else " dp")
        return f"{self.name} ({shape})"


def _straggler(
    name: str, topo: Topology, kind: str, target: int, mag: float, at: int, windows: int
) -> Scenario:
    fault = Fault(kind, at=at, target=target, mag=mag)  # type: ignore[arg-type]
    if kind == "host":
        ranks = tuple(range(target * topo.ranks_per_host, (target + 1) * topo.ranks_per_host))
        host = topo.host(ranks[0])
        expect = Expectation(f"straggler:host:host={host}", "straggler", "host", ranks, (host,))
    else:
        expect = Expectation(
            f"straggler:{kind}:rank={target}", "straggler", kind, (target,), (topo.host(target),)
        )
    return Scenario(name, topo, windows, (fault,), replace(expect, goal_windows=STRAGGLER_GOAL_WINDOWS))


def fault_scenarios(*, fast: bool = False) -> list[Scenario]:
    """One scenario per fault kind and layout (shorter runs with ``fast``)."""
    if fast:
        out = [
            _straggler("slow compute rank", DP_FAST, "compute", 6, 0.2, 4, 9),
            _straggler("slow link", DP_FAST, "link", 7, 1.0, 4, 9),
            _straggler("loader stall", DP_FAST, "data", 5, 0.15, 4, 9),
            _straggler("slow host", DP_FAST, "host", 2, 0.2, 4, 9),
        ]
    else:
        out = [
            _straggler("slow compute rank", DP, "compute", 13, 0.2, 6, 12),
            _straggler("slow compute rank", THREE_D, "compute", 45, 0.2, 6, 12),
            _straggler("slow link", DP, "link", 7, 1.0, 6, 12),
            _straggler("slow link", THREE_D, "link", 21, 0.5, 6, 12),
            _straggler("loader stall", DP, "data", 5, 0.15, 6, 12),
            _straggler("loader stall", THREE_D, "data", 33, 0.15, 6, 12),
            _straggler("slow host", DP, "host", 2, 0.2, 6, 12),
            _straggler("slow host", THREE_D, "host", 5, 0.2, 6, 12),
        ]
    # The baseline forms over the 12 windows after warm-up; the change starts after it.
    for component, word in (("compute_s", "compute"), ("comm_exposed_s", "comm"), ("data_wait_s", "data")):
        if fast and component != "compute_s":
            continue
        out.append(
            Scenario(
                f"job-wide +10% ({word})",
                ONE_HOST if fast else SMALL,
                24 if fast else 30,
                (Fault("mfu", at=16 if fast else 20, mag=PLUS_TEN_PERCENT, component=component),),
                Expectation(
                    "regression:step_time",
                    "regression",
                    component=component,
                    goal_windows=REGRESSION_GOAL_WINDOWS,
                    related=("regression:mfu",),
                ),
            )
        )
    drop_at, total = (36, 46) if fast else (45, 60)
    out.append(
        Scenario(
            "MFU drop 5%",
            ONE_HOST if fast else SMALL,
            total,
            (Fault("mfu", at=drop_at, mag=0.05, component="comm_exposed_s"),),
            Expectation(
                "regression:mfu",
                "regression",
                component="comm_exposed_s",
                goal_windows=MFU_GOAL_WINDOWS,
                related=("regression:step_time",),
            ),
        )
    )
    return out


def realtime_scenarios() -> list[Scenario]:
    """Hangs need real time to pass: short simulated steps, windows paced in real time."""
    quick = Noise(warmup_steps=4, checkpoint_every=0)
    return [
        Scenario(
            "hang",
            SMALL,
            12,
            (Fault("hang", at=8, target=3),),
            Expectation("hang:run", "hang", related=()),
            step_time_s=0.02,
            noise=quick,
            realtime=True,
        ),
        Scenario(
            "silent rank",
            SMALL,
            16,
            (Fault("silent", at=6, target=3),),
            Expectation("hang:rank=3", "hang", ranks=(3,), hosts=(SMALL.host(3),), related=()),
            step_time_s=0.02,
            noise=quick,
            realtime=True,
        ),
    ]


def clean_scenarios(*, fast: bool = False) -> list[Scenario]:
    """Clean runs for the collector path (a representative subset)."""
    noisy = Noise(checkpoint_every=160, eval_every=400, eval_steps=8)
    if fast:
        return [Scenario("clean", DP_FAST, 24, noise=noisy)]
    return [
        Scenario("clean", DP, 60, noise=noisy),
        Scenario("clean", THREE_D, 40, noise=noisy),
        Scenario("clean, untagged checkpoints", SMALL, 60, noise=_untagged(noisy)),
    ]


def _untagged(noise: Noise) -> Noise:
    """The same noise with checkpoints nobody tagged: a few long steps in the series."""
    return replace(noise, untagged_checkpoints=True)


def direct_clean_scenarios(*, fast: bool = False) -> list[Scenario]:
    """Long clean runs fed straight into the detectors (same model, no HTTP): the large count."""
    noisy = Noise(checkpoint_every=1000, eval_every=4000, eval_steps=16)
    if fast:
        return [
            Scenario("clean", SMALL, 400, noise=noisy),
            Scenario("clean", THREE_D, 100, noise=noisy),
            Scenario("clean, untagged checkpoints", ONE_HOST, 400, noise=_untagged(noisy)),
        ]
    return [
        Scenario("clean", DP, 800, noise=noisy),
        Scenario("clean", THREE_D, 600, noise=noisy),
        Scenario("clean (long)", Topology(hosts=1, ranks_per_host=8), 10_000, noise=noisy),
        Scenario("clean, untagged checkpoints (long)", ONE_HOST, 10_000, noise=_untagged(noisy)),
    ]
