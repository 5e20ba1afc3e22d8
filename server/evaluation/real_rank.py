"""One rank of the real-training evaluation (``python -m stepwatch_server.evaluation.real_rank``).

Run by :mod:`.real` under torchrun's environment (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``): a tiny GPT under DDP with small buckets (so the step
has many collectives, as a real model's does), the real agent, and one fault injected from
step ``--fault-from`` on the ranks in ``--fault-ranks``. Faults are real, not simulated:

``compute``
    Extra matmuls in forward: a loop whose iteration count is calibrated at the onset to
    ``--size`` of the step time measured just before it (CPU work that competes for cores,
    as a throttled device takes longer). When every rank is faulty (a job-wide slowdown)
    the loop's cost is measured in CPU time (``--size`` of the step in real work) and the
    ranks use the mean of their counts, so each does the same extra work and none becomes
    a straggler by the noise of its own calibration.
``host_stall``
    A ``time.sleep`` of ``--size`` of the step in forward: the host stalls, no work is done.
``loader``
    The data loader sleeps ``--size`` of the step before yielding each batch.
``comm``
    Extra communication: after backward the faulty rank and its neighbour all-reduce an
    extra tensor of ``--comm-mb`` MiB on a group of their own (one rank cannot move bytes
    alone in a collective, so its partner pays too), as many times per step as take
    ``--size`` of the step (timed at the onset; the pair agrees on the larger count), so
    that the fault is sized like the others whatever the machine's load.
``hang``
    The faulty rank never enters the gradients' all-reduce of step ``--fault-from``: it
    sleeps before backward until killed, and its peers wait inside the collective.
``link``
    Nothing in the process: the harness limits this rank's veth with ``tc tbf``.
``contention``
    Other work on the rank's host takes its cores: its training thread is pinned to one
    core with ``--burners`` busy-loop processes pinned beside it at niceness
    ``--burner-nice`` (started by this rank, killed with it), so the thread waits on the
    run queue; it does no extra work. (At niceness 0 two such loops slowed the whole
    job, since the scheduler moved the other ranks off that core, and rank 1 barely more.)

Each rank writes its own step end times to ``--out`` so the harness can tell when the
fault began on the wall clock.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import stepwatch
from stepwatch.demo.model import GPTConfig, TinyGPT, loss_fn

PAD_ID = 0
FAULTS = ("none", "compute", "host_stall", "loader", "comm", "hang", "link", "contention")


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--run", required=True)
    p.add_argument("--steps", type=int, default=144)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--fault", choices=FAULTS, default="none")
    p.add_argument("--fault-ranks", default="", help="comma-separated ranks the fault hits")
    p.add_argument("--fault-from", type=int, default=1 << 30, help="first faulty step (1-based)")
    p.add_argument("--size", type=float, default=0.2, help="fault size as a fraction of the step")
    p.add_argument("--comm-mb", type=float, default=4.0)
    p.add_argument("--burners", type=int, default=1, help="busy loops beside a contended rank")
    p.add_argument("--burner-nice", type=int, default=-5, help="their niceness relative to the rank's")
    p.add_argument("--host", default=None, help="host name the agent reports (default: the real one)")
    p.add_argument("--bucket-cap-mb", type=float, default=0.05)
    p.add_argument("--send-interval", type=float, default=2.0)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--profile-every", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON of this rank's step ends ({rank} is replaced)")
    p.add_argument("--record", default=None, help="also write every payload sent here ({rank} is replaced)")
    return p.parse_args(argv)


#: Side of the compute fault's matrices: the extra work comes in ops of about 0.3 ms (a
#: slower device runs longer kernels, not more of them). With 64 the extra ops of a +20%
#: fault made the raw trace of a 4-step capture 1.1-2.1 MB and over, at the collector's
#: 2 MiB cap, and the flagged rank's trace was then not kept.
MATMUL_N = 256


def _matmuls(n: int) -> None:
    a = torch.randn(MATMUL_N, MATMUL_N)
    for _ in range(n):
        a = torch.tanh(a @ a)


def _per_matmul_s(loops: int = 9, n: int = 25) -> float:
    """Wall time of one matmul as this rank gets it now (its share of a core on this busy
    host included): the median of ``loops`` short loops. One loop alone can catch a
    scheduler hop and size the fault several times smaller: with one loop, rank 2's extra
    CPU a step over 14 runs of "compute +20%" was 4.9-11.4 ms in 8 (one of them unflagged)
    and 22.5-43.8 ms in 6; with the median of 9 loops, 13.0-51.8 ms, and 14 of 14 flagged
    (both with 64x64 matmuls; with :data:`MATMUL_N`, 12.2-16.9 ms and 6 of 6 on a quiet host)."""
    times = []
    for _ in range(loops):
        t0 = time.perf_counter()
        _matmuls(n)
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)


def _comm_rounds(budget_s: float, buf: torch.Tensor, group: Any) -> int:
    """How many all-reduces of ``buf`` on the pair's ``group`` take ``budget_s``: one to
    line the pair up, then three timed; both ranks take the larger count."""
    dist.all_reduce(buf, group=group)
    t0 = time.perf_counter()
    for _ in range(3):
        dist.all_reduce(buf, group=group)
    one = (time.perf_counter() - t0) / 3
    n = torch.tensor([float(max(1, round(budget_s / max(one, 1e-6))))])
    dist.all_reduce(n, group=group, op=dist.ReduceOp.MAX)
    return int(n.item())


def _per_matmul_cpu_s() -> float:
    """The matmul's CPU time, over enough of them to be exact: on a busy host the wall
    time of a short loop counts the time it waited for a core as well."""
    t0 = time.thread_time()
    _matmuls(250)
    return (time.thread_time() - t0) / 250


def _batches(
    cfg: GPTConfig, batch: int, seed: int, stall: list[float]
) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
    """Random right-padded byte sequences; sleeps ``stall[0]`` seconds before each batch."""
    g = torch.Generator().manual_seed(seed)
    while True:
        if stall[0]:
            time.sleep(stall[0])
        n = torch.randint(cfg.seq_len // 2, cfg.seq_len + 1, (batch,), generator=g)
        seq = torch.randint(1, cfg.vocab, (batch, cfg.seq_len + 1), generator=g)
        pos = torch.arange(cfg.seq_len + 1).expand(batch, -1)
        seq = seq.masked_fill(pos > n.unsqueeze(1), PAD_ID)
        yield seq[:, :-1], seq[:, 1:], int(n.sum())


#: A busy loop that dies with the rank: ``PR_SET_PDEATHSIG`` set by the loop itself (not in
#: a ``preexec_fn``, unsafe in a process with gloo's threads), then a check that the rank
#: had not already gone before it was set.
_BURNER = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGKILL)\n"
    "if os.getppid() != int(sys.argv[1]): sys.exit(0)\n"
    "while True: pass\n"
)


def _contend(n: int, nice: int) -> list[subprocess.Popen[bytes]]:
    """Pin the calling (training) thread to one core and ``n`` busy loops beside it, at
    ``nice`` relative to this rank."""
    core = {min(os.sched_getaffinity(0))}
    os.sched_setaffinity(0, core)
    cmd = ["nice", "-n", str(nice), sys.executable, "-c", _BURNER, str(os.getpid())]
    procs = [subprocess.Popen(cmd) for _ in range(n)]
    for p in procs:
        os.sched_setaffinity(p.pid, core)
    return procs


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    burners: list[subprocess.Popen[bytes]] = []
    try:
        return _train(args, burners)
    finally:
        for p in burners:
            p.kill()
            p.wait()


def _train(args: argparse.Namespace, burners: list[subprocess.Popen[bytes]]) -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = TinyGPT(cfg)
    extra = {"matmuls": 0, "sleep_s": 0.0, "comm_rounds": 0}

    def fault_forward(_module: torch.nn.Module, _inputs: Any) -> None:
        if extra["matmuls"]:
            _matmuls(int(extra["matmuls"]))
        if extra["sleep_s"]:
            time.sleep(float(extra["sleep_s"]))

    model.register_forward_pre_hook(fault_forward)
    ddp = DDP(model, bucket_cap_mb=args.bucket_cap_mb)
    # Every rank builds the side group (new_group is collective); only the pair uses it.
    pair: list[int] = []
    fault_list = sorted(int(r) for r in args.fault_ranks.split(",") if r)
    faulty = rank in fault_list
    side = None
    if args.fault == "comm" and fault_list:
        pair = sorted({fault_list[0], (fault_list[0] + 1) % world})
        side = dist.new_group(pair)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-4)
    sw = stepwatch.init(
        run=args.run,
        model=model,
        seq_len=cfg.seq_len,
        dtype="fp32",
        peak_flops=5e10,
        host=args.host,
        send_interval_s=args.send_interval,
        warmup_steps=args.warmup_steps,
        profile_every=args.profile_every,
    )
    watch = getattr(sw, "watch", None)
    if watch is not None:  # always-on collective timing, where this agent has it
        # Which timing (per bucket: the comm hook; per step: DDP's built-in reduction
        # timed from autograd's callbacks), to compare the two on the same scenarios.
        mode = os.environ.get("STEPWATCH_EVAL_COMM_TIMING", "")
        if mode in ("step", "bucket"):
            watch(ddp, per_bucket=mode == "bucket")
        else:
            watch(ddp)
    sent: list[dict[str, Any]] = []
    if args.record:  # keep what the agent sent, as recorded inputs for the detectors' tests
        sender: Any = sw._sender  # the HTTP sender: its encoder is wrapped to keep a copy
        encode = sender._encode

        def recording(window: Any, stats: Any) -> bytes:
            body: bytes = encode(window, stats)
            sent.append(json.loads(body))
            return body

        sender._encode = recording
    stall = [0.0]
    comm_buf = torch.zeros(int(args.comm_mb * (1 << 20) / 4))
    ends: list[float] = []
    durations: list[float] = []
    last = time.perf_counter()
    batches = _batches(cfg, args.batch, seed=rank, stall=stall)
    for step, (x, y, n_real) in enumerate(sw.loader(batches), start=1):
        if step > args.steps:
            break
        if step == args.fault_from and faulty:
            base = statistics.median(durations[-8:]) if durations else 0.0
            if args.fault == "compute" and len(fault_list) == world:
                # Job-wide: the same extra work on every rank.
                extra["matmuls"] = max(1, round(args.size * base / _per_matmul_cpu_s()))
                count = torch.tensor([float(extra["matmuls"])])
                dist.all_reduce(count)
                extra["matmuls"] = max(1, round(float(count.item()) / world))
            elif args.fault == "compute":
                extra["matmuls"] = max(1, round(args.size * base / _per_matmul_s()))
            elif args.fault == "host_stall":
                extra["sleep_s"] = args.size * base
            elif args.fault == "loader":
                stall[0] = args.size * base
            elif args.fault == "contention":
                burners.extend(_contend(args.burners, args.burner_nice))
        if step == args.fault_from and side is not None and rank in pair:
            base = statistics.median(durations[-8:]) if durations else 0.0
            extra["comm_rounds"] = _comm_rounds(args.size * base, comm_buf, side)
        logits = ddp(x)
        loss = loss_fn(logits, y, PAD_ID)
        if args.fault == "hang" and faulty and step == args.fault_from:
            time.sleep(1e6)  # never enters this step's all-reduce; the harness kills it
        loss.backward()  # type: ignore[no-untyped-call]
        for _ in range(int(extra["comm_rounds"])):
            dist.all_reduce(comm_buf, group=side)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sw.step(tokens=n_real, padded_tokens=x.numel())
        now = time.perf_counter()
        durations.append(now - last)
        last = now
        ends.append(time.time())
    flushed = sw.close(timeout_s=20.0)
    if args.out:
        with open(args.out.format(rank=rank), "w") as f:
            json.dump(
                {"rank": rank, "world": world, "step_ends": ends, "flushed": flushed, "extra": extra}, f
            )
    if args.record:
        with open(args.record.format(rank=rank), "w") as f:
            json.dump(sent, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
