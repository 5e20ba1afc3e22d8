"""The always-on collective timing's cost: step time of 4 gloo ranks training a tiny GPT
under DDP with >= 8 buckets, with the timing hook against DDP's built-in all-reduce.

    python -m benchmarks.comm_timing [--rounds 8] [--steps 10]

Each rank builds four DDP copies of one model: ``builtin``, ``builtin, again``,
``python hook`` (torch's own ``allreduce_hook``: what any Python communication hook
costs over DDP's C++ reduction, stepwatch's or not) and ``timed`` (``stepwatch.comm_hook``
registered, its timing filled every step). A round
trains each copy ``--steps`` steps in a rotated order, all ranks in lock-step; a copy's
figure for the round is its median step time over the ranks' slowest (the job's step),
divided by ``builtin``'s of the same round (paired: a shared machine's drift cancels).
The result is the median ratio over rounds; ``builtin, again`` / ``builtin`` (an A/A
test) is the noise band, and ``timed`` / ``python hook`` is what stepwatch adds to a
Python hook. Budget (issue 11): timing <= 1% of step time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

RANKS = 4
CONFIGS = ("builtin", "builtin, again", "python hook", "timed")


def _worker(rank: int, init: str, out: str, rounds: int, steps: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from stepwatch import comm_hook
    from stepwatch._comm_timing import CommTiming
    from stepwatch.demo.model import GPTConfig, TinyGPT, loss_fn

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=RANKS)
    cfg = GPTConfig()
    pos = [1, 0]
    timing = CommTiming(steps, lambda: (pos[0], pos[1]))
    models = {}
    for name in CONFIGS:
        torch.manual_seed(0)
        m = DDP(TinyGPT(cfg), bucket_cap_mb=0.05)
        if name == "timed":
            m.register_comm_hook(None, comm_hook(timing=timing))
        elif name == "python hook":
            m.register_comm_hook(None, allreduce_hook)
        models[name] = (m, torch.optim.AdamW(m.parameters(), lr=3e-4))
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(1, cfg.vocab, (8, cfg.seq_len), generator=g)
    times: dict[str, list[list[float]]] = {c: [] for c in CONFIGS}
    for rnd in range(rounds + 1):  # round 0 warms every copy up (and rebuilds buckets)
        k = rnd % len(CONFIGS)
        order = CONFIGS[k:] + CONFIGS[:k]
        for name in order:
            model, opt = models[name]
            own = []
            for i in range(steps):
                pos[1] = i
                t0 = time.perf_counter()
                loss_fn(model(x), x, 0).backward()  # type: ignore[no-untyped-call]
                opt.step()
                opt.zero_grad(set_to_none=True)
                own.append(time.perf_counter() - t0)
            if name == "timed":
                timing.take(steps)  # what the window hand-off does
                pos[0] += steps
            if rnd:
                times[name].append(own)
    with open(out.format(rank=rank), "w") as f:
        json.dump({"times": times, "buckets": int(timing._n_buckets[0])}, f)
    dist.destroy_process_group()


def bookkeeping_s(n: int = 20_000) -> float:
    """The hook's own work per bucket (arrival and completion records), in seconds: with
    the buckets per step it bounds the cost independently of the step-time noise."""
    from stepwatch._comm_timing import CommTiming

    pos = [1, 0]
    timing = CommTiming(1024, lambda: (pos[0], pos[1]))
    t0 = time.perf_counter()
    for k in range(n):
        pos[1] = (k // 8) % 1024
        timing.done(timing.arrive("world", k % 8, 4096), "world")
    return (time.perf_counter() - t0) / n


def run(rounds: int = 8, steps: int = 10) -> dict[str, float]:
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{Path(tmp) / 'store'}"
        out = str(Path(tmp) / "rank{rank}.json")
        mp.spawn(_worker, args=(init, out, rounds, steps), nprocs=RANKS, join=True)
        per_rank = [json.loads(Path(out.format(rank=r)).read_text()) for r in range(RANKS)]
    ratios: dict[str, list[float]] = {c: [] for c in CONFIGS[1:]}
    step_s = []
    own: list[float] = []
    for rnd in range(rounds):
        # The job's step: per step, the slowest rank; then the round's median.
        job = {
            c: statistics.median(max(r["times"][c][rnd][i] for r in per_rank) for i in range(steps))
            for c in CONFIGS
        }
        step_s.append(job["builtin"])
        for c in CONFIGS[1:]:
            ratios[c].append(job[c] / job["builtin"])
        own.append(job["timed"] / job["python hook"])
    return {
        "step_s": statistics.median(step_s),
        "buckets": float(per_rank[0]["buckets"]),
        "aa_ratio": statistics.median(ratios["builtin, again"]),
        "aa_spread": max(abs(r - 1) for r in ratios["builtin, again"]),
        "timed_ratio": statistics.median(ratios["timed"]),
        "python_ratio": statistics.median(ratios["python hook"]),
        "own_ratio": statistics.median(own),
        "rounds": float(rounds),
        "bookkeeping_s": bookkeeping_s(),
    }


def report(f: dict[str, float]) -> list[str]:
    return [
        f"comm timing: 4 gloo ranks, {f['buckets']:.0f} DDP buckets, step {f['step_s'] * 1e3:.0f} ms "
        f"(median of {f['rounds']:.0f} paired rounds)",
        f"  timed hook / built-in all-reduce: {f['timed_ratio']:.4f} ({(f['timed_ratio'] - 1) * 100:+.2f}%)",
        f"  torch's allreduce_hook / built-in: {f['python_ratio']:.4f} "
        f"({(f['python_ratio'] - 1) * 100:+.2f}%)",
        f"  timed hook / allreduce_hook:      {f['own_ratio']:.4f} ({(f['own_ratio'] - 1) * 100:+.2f}%) "
        "(what stepwatch adds to a Python hook)",
        f"  A/A (built-in / built-in):        {f['aa_ratio']:.4f} ({(f['aa_ratio'] - 1) * 100:+.2f}%), "
        f"largest round {f['aa_spread'] * 100:.1f}%",
        f"  hook bookkeeping: {f['bookkeeping_s'] * 1e6:.2f} us per bucket = "
        f"{f['bookkeeping_s'] * f['buckets'] / f['step_s'] * 100:.3f}% of this step",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args(argv)
    for line in report(run(args.rounds, args.steps)):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
