"""One rank of the demo training: ``python -m stepwatch.demo.train`` under a launcher
that sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (torchrun, or
``stepwatch.demo.launch``).

Faults can be injected for tests and the demo: a slow rank (extra time inside its
forward: a compute straggler), a stalled loader on one rank (a data straggler) and a hang (one
rank stops inside a step; the others then block in the next all-reduce).

The slow rank's extra time comes in three kinds (``--slow-kind``):

``busy`` (default)
    Real matmuls for the time: real extra compute, which competes for the cores like the
    work of a rank whose device is slower. The always-on timing (that ``sw.watch`` installs
    on the DDP model) sees the rank arrive last at every all-reduce having done more
    work, and names it a compute straggler without the profiler.
``op``
    A custom ATen op (``stepwatch_demo::throttle``) that holds the host for the time
    without using the CPU: to the profiler it is an operator that runs longer, as a
    kernel of a throttled GPU does, and it leaves the cores to the other ranks, so the
    effect does not drown in CPU contention when ranks outnumber cores.
``sleep``
    A plain ``time.sleep``: the profiler counts it as idle (host time outside operators).

Each rank also times its own loop, independently of stepwatch, and writes that to ``--out`` so tests
can compare what the collector reports against what the rank itself measured.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

import stepwatch

from .model import GPTConfig, TinyGPT, loss_fn

PAD_ID = 0


class SyntheticText(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """Random byte sequences of random length, right-padded: real and padding tokens."""

    def __init__(self, cfg: GPTConfig, size: int, seed: int, stall_s: float = 0.0) -> None:
        self.cfg, self.size, self.seed, self.stall_s = cfg, size, seed, stall_s

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        if self.stall_s:
            time.sleep(self.stall_s)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        n = int(torch.randint(self.cfg.seq_len // 2, self.cfg.seq_len + 1, (1,), generator=g))
        seq = torch.full((self.cfg.seq_len + 1,), PAD_ID, dtype=torch.long)
        seq[: n + 1] = torch.randint(1, self.cfg.vocab, (n + 1,), generator=g)
        return seq[:-1], seq[1:], n


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--run", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--peak-flops", type=float, default=None, help="declared peak FLOP/s of one rank")
    p.add_argument("--send-interval", type=float, default=2.0)
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-ms", type=float, default=0.0)
    p.add_argument("--slow-from", type=int, default=0, help="first step (1-based) of the slowdown")
    p.add_argument("--slow-to", type=int, default=1 << 30, help="last step of the slowdown")
    p.add_argument("--slow-kind", choices=("op", "busy", "sleep"), default="busy", help="see the docstring")
    p.add_argument("--profile-every", type=int, default=None, help="profiler window period (0: off)")
    p.add_argument("--profile-steps", type=int, default=None, help="steps per profiler window")
    p.add_argument("--profile-budget", type=float, default=None, help="profiler cost budget (0-1)")
    p.add_argument("--stall-rank", type=int, default=-1, help="rank whose loader stalls")
    p.add_argument("--stall-ms", type=float, default=0.0, help="extra loader time per sample")
    p.add_argument("--hang-rank", type=int, default=-1, help="rank that hangs")
    p.add_argument("--hang-step", type=int, default=0, help="step (1-based) in which it hangs")
    p.add_argument("--hang-s", type=float, default=0.0, help="how long it hangs, seconds")
    p.add_argument("--out", default=None, help="write this rank's own timings as JSON ({rank} is replaced)")
    return p.parse_args(argv)


@torch.library.custom_op("stepwatch_demo::throttle", mutates_args=())
def throttle(x: torch.Tensor, seconds: float) -> torch.Tensor:
    """An operator that takes ``seconds`` without using the CPU (see the module docstring)."""
    time.sleep(seconds)
    return x.clone()


def busy_for(seconds: float) -> None:
    """Real compute for ``seconds``, as a throttled device would take longer: a 512x512
    matmul and its tanh take about 1.5 ms on one core here, so the profiler sees 120 ms of
    extra time as some 150 operators, fewer than a step's own. With 64x64 matmuls (some
    20,000 operators per step) the slow rank's profiler window cost 1.6 s to parse against
    its peers' 0.1 s, the budget stretched its period from 8 to 32 steps, and the window
    detector, seeing it profiled once after it recovered, kept its flag open to the end.
    (The real-training harness sizes its extra compute the same way,
    ``server/evaluation/real_rank.py``.)"""
    a = torch.randn(512, 512)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        a = torch.tanh(a @ a)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = TinyGPT(cfg)
    step_now = [0]
    if rank == args.slow_rank and args.slow_ms > 0:
        slow_s = args.slow_ms / 1000.0

        def slow_forward(_module: torch.nn.Module, inputs: Any) -> Any:
            if not args.slow_from <= step_now[0] <= args.slow_to:
                return None
            if args.slow_kind == "op":  # a compute straggler, inside forward
                return (throttle(inputs[0], slow_s), *inputs[1:])
            busy_for(slow_s) if args.slow_kind == "busy" else time.sleep(slow_s)
            return None

        model.register_forward_pre_hook(slow_forward)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-4)
    sw = stepwatch.init(
        run=args.run,
        model=model,
        seq_len=cfg.seq_len,
        dtype="fp32",
        peak_flops=args.peak_flops,
        send_interval_s=args.send_interval,
        warmup_steps=args.warmup_steps,
        profile_every=args.profile_every,
        profile_steps=args.profile_steps,
        profile_budget=args.profile_budget,
    )
    sw.watch(ddp)  # always-on collective timing: who arrives last at each all-reduce
    stall_s = args.stall_ms / 1000.0 / args.batch if rank == args.stall_rank else 0.0
    data = SyntheticText(cfg, size=args.steps * args.batch, seed=rank, stall_s=stall_s)
    loader = DataLoader(data, batch_size=args.batch, num_workers=0)
    ends: list[float] = []
    cpu_ends: list[float] = []  # this process's CPU time (all threads) at each step end
    tokens: list[int] = []
    t_start = time.perf_counter()
    for step, (x, y, n_real) in enumerate(sw.loader(loader), start=1):
        if rank == args.hang_rank and step == args.hang_step:
            time.sleep(args.hang_s)  # a hang: this rank stops, the others wait in the all-reduce
        step_now[0] = step
        logits = ddp(x)
        loss = loss_fn(logits, y, PAD_ID)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad(set_to_none=True)
        n_tokens = int(n_real.sum())
        sw.step(tokens=n_tokens, padded_tokens=x.numel())
        ends.append(time.perf_counter())
        cpu_ends.append(time.process_time())
        tokens.append(n_tokens)
    t_loop_end = time.perf_counter()
    flushed = sw.close(timeout_s=20.0)
    t_closed = time.perf_counter()
    if args.out:
        result: dict[str, Any] = {
            "rank": rank,
            "world_size": world,
            "start": t_start,
            "close_s": t_closed - t_loop_end,
            "step_ends": ends,
            "cpu_ends": cpu_ends,
            "tokens": tokens,
            "flushed": flushed,
            "stats": sw.stats,
            "convention": sw.convention,
        }
        with open(args.out.format(rank=rank), "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
