"""Training step time with the agent against no agent, on real 2-rank gloo training,
with the collector up, down (nothing listens), or up but answering only after 10 s.

    python -m benchmarks.agent_overhead [--rounds 3] [--steps 60]

Each configuration trains ``stepwatch.demo.train`` (a tiny GPT, DDP over gloo) with the
ranks timing their own steps independently of stepwatch. A round runs every
configuration once, in a rotated order, and each configuration's median step time is
divided by the no-agent one of the same round (paired: drift of a shared machine between
rounds cancels); the figure is the median of those ratios over rounds. No agent runs
twice per round: the ratio of the second run to the first (an A/A test) is the noise
band the other ratios should sit within.
Budget (DESIGN §7): step time within noise of no agent, whatever the collector does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
from collections.abc import Iterator, Sequence
from itertools import pairwise
from pathlib import Path

from stepwatch.demo import launch
from tests.live import CollectorProcess, SlowServer

from ._harness import median

CONFIGS = ("no agent", "no agent, again", "collector up", "collector down", "collector slow (10 s)")
WARMUP = 5


@contextlib.contextmanager
def _target(config: str, workdir: Path) -> Iterator[dict[str, str]]:
    if config.startswith("no agent"):
        yield {"STEPWATCH_DISABLED": "1"}
    elif config == "collector down":
        yield {"STEPWATCH_URL": f"http://127.0.0.1:{launch.free_port()}"}
    elif config == "collector slow (10 s)":
        with SlowServer(delay_s=10.0) as slow:
            yield {"STEPWATCH_URL": slow.url}
    else:
        from stepwatch_server.storage import migrate

        db = f"sqlite:///{workdir / 'bench.db'}"
        migrate.upgrade(db)
        collector = CollectorProcess(db, str(workdir / "collector.log"))
        collector.start()
        try:
            yield {"STEPWATCH_URL": collector.url}
        finally:
            collector.stop()


def _step_time(config: str, steps: int, workdir: Path) -> float:
    out = workdir / "rank{rank}.json"
    args = ["--run", "overhead", "--steps", str(steps), "--send-interval", "1", "--out", str(out)]
    with _target(config, workdir) as env:
        env = {**env, "STEPWATCH_FLUSH_TIMEOUT_S": "2"}
        with launch.ranks(2, args, env=env, log_dir=str(workdir)) as procs:
            launch.wait_all(procs, timeout_s=600, log_dir=str(workdir))
    per_rank = []
    for r in range(2):
        ends = json.loads((workdir / f"rank{r}.json").read_text())["step_ends"]
        per_rank.append(statistics.median(b - a for a, b in pairwise(ends[WARMUP:])))
    return sum(per_rank) / len(per_rank)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args(argv)
    times: dict[str, list[float]] = {c: [] for c in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="stepwatch-overhead-") as tmp:
        for rnd in range(args.rounds):
            order = CONFIGS[rnd % len(CONFIGS) :] + CONFIGS[: rnd % len(CONFIGS)]
            for config in order:
                workdir = Path(tmp) / f"{rnd}-{CONFIGS.index(config)}"
                workdir.mkdir()
                times[config].append(_step_time(config, args.steps, workdir))
    ratios = {c: [t / base for t, base in zip(times[c], times["no agent"], strict=True)] for c in CONFIGS}
    noise = max(abs(r - 1) for r in ratios["no agent, again"])
    print(f"agent overhead: 2 gloo ranks, {args.steps} steps, {args.rounds} paired rounds")
    for config in CONFIGS:
        print(
            f"  {config:24s} {median(times[config]) * 1e3:8.1f} ms/step   "
            f"ratio to no agent (same round) {median(ratios[config]):5.3f}"
        )
    print(f"  noise band (A/A: no agent against itself): ±{noise:.1%}")
    worst = max(abs(median(ratios[c]) - 1) for c in CONFIGS[2:])
    print(f"  budget (within noise): {'met' if worst <= max(noise, 0.02) else 'MISSED'} (worst {worst:.1%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
