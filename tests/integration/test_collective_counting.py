"""The ``torch.distributed`` counting wrappers on 4 real gloo ranks: results bit-identical
to the unwrapped calls, counters exact per group after a mix of sync and async calls
(point-to-point in its own per-pair sequence, a non-member's no-op not counted, a DDP
hook's all-reduce not counted twice), FSDP2's all-gathers and reduce-scatters counted,
and a rank that skips a collective of a subgroup diagnosed from the real counters by the
collector's ``stuck_collectives``."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from stepwatch import _collectives
from stepwatch._comm_timing import SEQ_RING, CommTiming, comm_hook
from stepwatch.wire import COLLECTIVE_OPS
from stepwatch_server.analysis.stuck_collectives import GroupCounters, stuck_collectives

from .. import gloo_ranks

RANKS = 4
#: The subgroup one rank of which skips a collective.
SUB = [1, 2, 3]
SKIPPER = 2
FSDP_STEPS = 2


def _ops(timing: CommTiming, group: str) -> list[str]:
    g = timing.seq[group]
    return [COLLECTIVE_OPS[g.ops[n % SEQ_RING]] for n in range(1, g.entered + 1)]


def _mix(rank: int, sub: Any, orig: dict[str, Any]) -> tuple[int, Counter[str]]:
    """Every wrapped op, wrapped and unwrapped on the same inputs. Returns the number of
    results that differ and the calls made through the wrappers, per group label."""
    diff = 0
    made: Counter[str] = Counter()

    def same(a: torch.Tensor | list[torch.Tensor], b: torch.Tensor | list[torch.Tensor]) -> None:
        nonlocal diff
        pairs = zip(a, b, strict=True) if isinstance(a, list) else [(a, b)]
        diff += sum(int(not torch.equal(x, y)) for x, y in pairs)  # type: ignore[arg-type]

    g = torch.Generator().manual_seed(rank)
    x = torch.randn(8, generator=g)
    for name, async_op in (("all_reduce", False), ("all_reduce", True)):
        a, b = x.clone(), x.clone()
        w = getattr(dist, name)(a, async_op=async_op)
        if w is not None:
            w.wait()
        orig[name](b)
        same(a, b)
        made["world"] += 1
    for async_op in (False, True):
        outs = [torch.empty(8) for _ in range(RANKS)]
        refs = [torch.empty(8) for _ in range(RANKS)]
        w = dist.all_gather(outs, x, async_op=async_op)
        if w is not None:
            w.wait()
        orig["all_gather"](refs, x)
        same(outs, refs)
        made["world"] += 1
    for name in ("all_gather_single", "all_gather_into_tensor"):
        a, b = torch.empty(8 * RANKS), torch.empty(8 * RANKS)
        dist.all_gather_single(a, x) if name == "all_gather_single" else dist.all_gather_into_tensor(a, x)
        orig[name](b, x)
        same(a, b)
        made["world"] += 1
    big = torch.randn(8 * RANKS, generator=g)
    for name, async_op in (("reduce_scatter_single", True), ("reduce_scatter_tensor", False)):
        a, b = torch.empty(8), torch.empty(8)
        w = getattr(dist, name)(a, big, async_op=async_op)
        if w is not None:
            w.wait()
        orig[name](b, big)
        same(a, b)
        made["world"] += 1
    a, b = torch.empty(8 * RANKS), torch.empty(8 * RANKS)
    dist.all_to_all_single(a, big, async_op=True).wait()
    orig["all_to_all_single"](b, big)
    same(a, b)
    made["world"] += 1
    for async_op in (False, True):
        a, b = x.clone(), x.clone()
        w = dist.broadcast(a, 1, async_op=async_op)
        if w is not None:
            w.wait()
        orig["broadcast"](b, 1)
        same(a, b)
        made["world"] += 1
    parts = [torch.randn(8, generator=g) for _ in range(RANKS)]
    outs, refs = [torch.empty(8) for _ in range(RANKS)], [torch.empty(8) for _ in range(RANKS)]
    dist.all_to_all(outs, parts, async_op=True).wait()
    orig["all_to_all"](refs, parts)
    same(outs, refs)
    a, b = torch.empty(8), torch.empty(8)
    dist.reduce_scatter(a, parts)
    orig["reduce_scatter"](b, parts)
    same(a, b)
    # reduce and gather: the result is defined on the destination only.
    a, b = x.clone(), x.clone()
    dist.reduce(a, 0, async_op=True).wait()
    orig["reduce"](b, 0)
    outs, refs = [torch.zeros(8) for _ in range(RANKS)], [torch.zeros(8) for _ in range(RANKS)]
    dist.gather(x, outs if rank == 0 else None, dst=0)
    orig["gather"](x, refs if rank == 0 else None, dst=0)
    if rank == 0:
        same(a, b)
        same(outs, refs)
    a, b = torch.empty(8), torch.empty(8)
    dist.scatter(a, parts if rank == 3 else None, src=3, async_op=True).wait()
    orig["scatter"](b, parts if rank == 3 else None, src=3)
    same(a, b)
    dist.barrier()
    dist.barrier(async_op=True).wait()
    made["world"] += 7
    # The subgroup: its members only; rank 0's calls of it are no-ops, not counted.
    a, b = x.clone(), x.clone()
    dist.all_reduce(a, group=sub)
    orig["all_reduce"](b, group=sub)
    if rank in SUB:
        same(a, b)
        made[sub.group_name] += 1
    # Point-to-point, synchronous: pairs (0, 1) and (2, 3), both directions, each pair in
    # a sequence of its own.
    peer = rank ^ 1
    a = torch.full((4,), float(rank))
    got = torch.empty(4)
    for first in range(2):
        if (rank % 2) == first:
            dist.send(a, peer)
        else:
            dist.recv(got, src=peer)
            diff += int(not torch.equal(got, torch.full((4,), float(peer))))
        made[f"world:p2p:{min(rank, peer)}-{max(rank, peer)}"] += 1
    return diff, made


def _worker(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=RANKS)
    sub = dist.new_group(SUB)
    pos = [1, 0]
    timing = CommTiming(16, lambda: (pos[0], pos[1]))
    orig = {name: getattr(dist, name) for name in [*_collectives.COLLECTIVES, *_collectives.P2P]}
    result: dict[str, Any] = {"rank": rank, "installed": _collectives.install(timing)}
    result["wrapped"] = sorted(n for n, f in orig.items() if getattr(dist, n) is not f)
    result["diff"], made = _mix(rank, sub, orig)
    result["made"] = dict(made)
    # A DDP step whose comm hook wraps a user's hook that calls dist.all_reduce itself:
    # the bucket is counted once, by the hook.
    before = timing.seq["world"].entered
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Linear(8, 4))
    ddp.register_comm_hook(None, comm_hook(fp16_compress_hook, timing=timing))
    ddp(torch.randn(2, 8)).sum().backward()
    result["ddp_counted"] = timing.seq["world"].entered - before
    result["ddp_buckets"] = list(timing.take(1).n_buckets)  # type: ignore[union-attr]
    result["seq"] = timing.groups()

    # FSDP2 on gloo: its all-gathers and reduce-scatters, counted in a fresh timing.
    from torch.distributed.fsdp import fully_shard

    fsdp_timing = CommTiming(16, lambda: (pos[0], pos[1]))
    _collectives.install(fsdp_timing)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(FSDP_STEPS):
        model(torch.randn(3, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    result["fsdp_seq"] = fsdp_timing.groups()
    result["fsdp_ops"] = dict(Counter(_ops(fsdp_timing, "world")))

    # The hang: ranks 1 and 3 enter the subgroup's first all-reduce, which rank 2 skips
    # (it never called a collective of that group: it is listed at 0 from torch's group
    # registry, else it would be absent, not missing). The counters are read while the
    # all-reduce is in flight; rank 2 joins only after every rank read them.
    hang_timing = CommTiming(16, lambda: (pos[0], pos[1]))
    _collectives.install(hang_timing)
    t = torch.ones(4)
    work = None
    if rank in SUB and rank != SKIPPER:
        work = dist.all_reduce(t, group=sub, async_op=True)
    result["hang_seq"] = hang_timing.groups()
    result["sub"] = sub.group_name if rank in SUB else None
    dist.distributed_c10d.barrier()  # the original: after the read, counted nowhere
    if rank == SKIPPER:
        dist.all_reduce(t, group=sub)
    if work is not None:
        work.wait()
    result["after_seq"] = hang_timing.groups()
    _collectives.uninstall()
    result["restored"] = all(getattr(dist, n) is f for n, f in orig.items())
    with open(out.format(rank=rank), "w") as f:
        json.dump(result, f)
    dist.distributed_c10d.barrier()
    dist.destroy_process_group()


def test_wrappers_count_every_collective_exactly_and_diagnose_a_skipped_one(tmp_path: Path) -> None:
    init = f"file://{tmp_path / 'store'}"
    out = str(tmp_path / "rank{rank}.json")
    gloo_ranks.spawn(_worker, (init, out), RANKS)
    results = [json.loads(Path(out.format(rank=r)).read_text()) for r in range(RANKS)]
    sub = results[SUB[0]]["sub"]
    for r in results:
        assert r["installed"] is True and r["restored"] is True
        assert r["wrapped"] == sorted([*_collectives.COLLECTIVES, *_collectives.P2P]), "all wrapped"
        assert r["diff"] == 0, "a wrapped call's result differs from the unwrapped call's"
        seq = {g["group"]: g for g in r["seq"]}
        made = r["made"]
        made["world"] += r["ddp_counted"]
        # Exactly the calls made, per group: every one entered and completed.
        assert {g: (s["entered"], s["completed"]) for g, s in seq.items()} == {
            g: (n, n) for g, n in made.items()
        }
        assert r["ddp_counted"] == sum(r["ddp_buckets"]) >= 1, "a DDP bucket counted twice"
        assert (sub in seq) == (r["rank"] in SUB), "a non-member's no-op was counted"
        assert seq[f"world:p2p:{r['rank'] & ~1}-{r['rank'] | 1}"]["op"] in ("send", "recv")
        # FSDP2: two sharded layers, each all-gathered and its gradient reduce-scattered.
        fsdp_groups = {g["group"]: g for g in r["fsdp_seq"]}
        fsdp = fsdp_groups.pop("world")
        assert fsdp["entered"] == fsdp["completed"] > 0
        assert all(g["entered"] == 0 for g in fsdp_groups.values()), "FSDP2 used only the world"
        ops = r["fsdp_ops"]
        assert set(ops) == {"all_gather", "reduce_scatter"}, ops
        assert ops["reduce_scatter"] == 2 * FSDP_STEPS and ops["all_gather"] >= 2 * FSDP_STEPS
        assert sum(ops.values()) == fsdp["entered"]
        # After the skipper joined, the subgroup's counters agree again.
        if r["rank"] in SUB:
            (after,) = [g for g in r["after_seq"] if g["group"] == sub]
            assert after["entered"] == after["completed"] == 1
    assert len({json.dumps(r["fsdp_ops"], sort_keys=True) for r in results}) == 1

    # The collector's diagnosis from the counters read while ranks 1 and 3 waited.
    counters = [
        GroupCounters(
            r["rank"], g["group"], g["entered"], g["completed"], g.get("op"), g.get("since"), True, 60.0
        )
        for r in results
        for g in r["hang_seq"]
    ]
    skipped = [g for g in results[SKIPPER]["hang_seq"] if g["group"] == sub]
    assert skipped == [{"group": sub, "entered": 0, "completed": 0}]
    (stuck,) = stuck_collectives(counters, list(range(RANKS)), min_idle_s=30.0)
    assert (stuck.group, stuck.op, stuck.seq, stuck.never_entered, stuck.waiting) == (
        sub,
        "all_reduce",
        1,
        (SKIPPER,),
        (1, 3),
    )
    assert stuck.unconfirmed == () and stuck.went_past == ()
