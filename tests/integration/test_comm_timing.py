"""The timing hook on 4 real gloo ranks: gradients bit-identical to DDP's built-in
all-reduce (and to a user's hook it wraps), every bucket timed, sequence counters exact."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from stepwatch import comm_hook
from stepwatch._comm_timing import CommTiming, count_buffer_broadcast, summarise
from stepwatch.demo.model import GPTConfig, TinyGPT, loss_fn

from .. import gloo_ranks

RANKS, STEPS = 4, 3
#: In the broadcast part, this rank enters step 2's buffer broadcast this late.
LATE_RANK, LATE_S = 3, 0.3
#: ... in this step (0-based): past the second, in which DDP rebuilds its buckets and
#: broadcasts their order, a wait for every rank of its own.
LATE_STEP = 2
#: ... and this rank sleeps as long in a forward pre-hook of its own (after the broadcast).
BUSY_RANK = 2
CFG = GPTConfig(n_layers=2, d_model=64, n_heads=4, seq_len=32)


def _pair(
    hook_b: object, hook_a: object = None
) -> tuple[DDP, DDP, torch.optim.Optimizer, torch.optim.Optimizer]:
    torch.manual_seed(0)
    a = DDP(TinyGPT(CFG), bucket_cap_mb=0.01)
    torch.manual_seed(0)
    b = DDP(TinyGPT(CFG), bucket_cap_mb=0.01)
    if hook_a is not None:
        a.register_comm_hook(None, hook_a)
    b.register_comm_hook(None, hook_b)
    return a, b, torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)


def _backward_both(a: DDP, b: DDP, x: torch.Tensor) -> int:
    """One backward of each copy on the same batch: how many gradients differ."""
    for model in (a, b):
        loss_fn(model(x), x, 0).backward()  # type: ignore[no-untyped-call]
    mismatches = 0
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert pa.grad is not None and pb.grad is not None
        mismatches += int(not torch.equal(pa.grad, pb.grad))
    return mismatches


def _worker(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=RANKS)
    pos = [1, 0]
    timing = CommTiming(16, lambda: (pos[0], pos[1]))
    result: dict[str, object] = {"rank": rank}
    for name, inner in (("builtin", None), ("fp16", fp16_compress_hook)):
        a, b, oa, ob = _pair(comm_hook(inner, timing=timing), inner)
        mismatches = 0
        g = torch.Generator().manual_seed(rank)
        for step in range(STEPS):
            pos[1] = step if name == "builtin" else STEPS + step
            x = torch.randint(1, CFG.vocab, (4, CFG.seq_len), generator=g)
            mismatches += _backward_both(a, b, x)
            for opt in (oa, ob):
                opt.step()
                opt.zero_grad(set_to_none=True)
        result[name] = mismatches
    n = 2 * STEPS
    slices = timing.take(n)
    assert slices is not None
    section, _ = summarise(slices, 1, [float(i + 1) * 1e6 for i in range(n)], [1e6] * n, None)
    result["buckets"] = list(slices.n_buckets)
    result["seq"] = timing.groups()
    result["section"] = section
    # DDP's broadcast of the model's buffers (TinyGPT's causal mask) before each forward
    # is counted in the sequence, between the steps' all-reduces; a call of the wrapped
    # module outside DDP broadcasts nothing and counts nothing.
    bt = CommTiming(16, lambda: (pos[0], pos[1]))
    torch.manual_seed(0)
    inner = TinyGPT(CFG)
    if rank == BUSY_RANK:  # the user's own pre-hook, registered before stepwatch's: not broadcast

        def busy(_m: object, _i: object) -> None:
            if pos[1] == LATE_STEP:
                time.sleep(LATE_S)

        inner.register_forward_pre_hook(busy)
    c = DDP(inner, bucket_cap_mb=0.01)
    c.register_comm_hook(None, comm_hook(timing=bt))
    result["broadcast_hooked"] = count_buffer_broadcast(c, bt)
    for step in range(LATE_STEP + 1):
        pos[1] = step
        x = torch.randint(1, CFG.vocab, (4, CFG.seq_len))
        if step == LATE_STEP and rank == LATE_RANK:
            time.sleep(LATE_S)  # a slow loader: this rank enters the broadcast late
        if step == LATE_STEP:  # when it entered (the host clock: comparable across ranks)
            result["broadcast_entered_s"] = time.perf_counter()
        loss_fn(c(x), x, 0).backward()  # type: ignore[no-untyped-call]
    with torch.no_grad():
        c.module(x)
    bslices = bt.take(LATE_STEP + 1)
    assert bslices is not None
    result["broadcast_buckets"] = list(bslices.n_buckets)
    result["broadcast_seq"] = bt.groups()
    n_b = LATE_STEP + 1
    ends = [1e6 * (i + 1) for i in range(n_b)]
    result["broadcast_section"], _ = summarise(bslices, 1, ends, [1e6] * n_b, None)
    with open(out.format(rank=rank), "w") as f:
        json.dump(result, f)
    # Every rank leaves together, as the demo's ranks do: a gloo rank that tears its group
    # down while a peer still talks to it can abort ("terminate called without an active
    # exception", seen once under CI).
    dist.barrier()
    dist.destroy_process_group()


def test_hook_keeps_gradients_bit_identical_and_times_every_bucket(tmp_path: Path) -> None:
    init = f"file://{tmp_path / 'store'}"
    out = str(tmp_path / "rank{rank}.json")
    gloo_ranks.spawn(_worker, (init, out), RANKS)
    results = [json.loads(Path(out.format(rank=r)).read_text()) for r in range(RANKS)]
    for r in results:
        assert r["builtin"] == 0, "gradients differ from DDP's built-in all-reduce"
        assert r["fp16"] == 0, "gradients differ from the wrapped user hook alone"
        buckets = r["buckets"]
        # DDP rebuilds its buckets in gradient order after the first iteration of a model.
        assert min(buckets[1:STEPS] + buckets[STEPS + 1 :]) >= 8, buckets
        (world,) = r["seq"]
        assert world["group"] == "world" and world["op"] == "all_reduce"
        assert world["entered"] == world["completed"] == sum(buckets), (
            "every collective entered was completed"
        )
        sec = r["section"]
        (coll,) = sec["collectives"]
        assert coll["count"] == sum(buckets) and coll["bytes"] > 0
        assert all(type(v) is int and v >= 0 for k in ("arrive_us", "sync_us") for v in sec[k])
        assert sec["cpu_us"][0] is None and all(v is not None and v > 0 for v in sec["cpu_us"][1:])
        (bseq,) = r["broadcast_seq"]
        assert r["broadcast_hooked"] is True
        assert bseq["entered"] == bseq["completed"] == sum(r["broadcast_buckets"]) + LATE_STEP + 1, bseq
        # Each forward's wait in the broadcast, per step (the wrapped module's call outside
        # DDP broadcasts nothing and adds nothing).
        held = r["broadcast_section"]["broadcast_us"]
        assert len(held) == LATE_STEP + 1 and all(v is not None and v >= 0 for v in held), held
    # The broadcast is a dependency, not only a meeting point: gloo relays rank 0's buffers
    # along a tree in which rank 1 receives through rank 3, so rank 3's late entry holds
    # rank 1 (which then reaches its all-reduce late with no more work: what the collector
    # must not take for a straggler), while rank 3 itself barely waits there.
    # How long rank 1 is held is measured against when the two entered, not assumed from
    # the sleep: on a loaded machine rank 1 can lose its core before its own entry, and
    # then it really is held less (what failed the all-reduce's twin test under CI load).
    held_late = [r["broadcast_section"]["broadcast_us"][LATE_STEP] * 1e-6 for r in results]
    entered = [r["broadcast_entered_s"] for r in results]
    behind = entered[LATE_RANK] - entered[1]
    assert behind >= 0.5 * LATE_S, (entered, held_late)  # the late rank did come late
    assert held_late[1] >= 0.8 * behind and held_late[LATE_RANK] < 0.5 * LATE_S, (entered, held_late)
    # The user's pre-hook runs after the broadcast: its sleep is not a wait there.
    assert held_late[BUSY_RANK] < 0.5 * LATE_S, (entered, held_late)
    # The same bytes on every rank: one collective is one collective everywhere.
    assert len({r["section"]["collectives"][0]["bytes"] for r in results}) == 1


def _subgroup_worker(rank: int, init: str, out: str) -> None:
    """Two data-parallel groups of 2 ({0, 1}, {2, 3}), each rank its own data: DDP on its
    group with the built-in reduction, and the same DDP watched by the agent."""
    from stepwatch._agent import Stepwatch
    from stepwatch._env import detect
    from stepwatch._sender import MemorySink
    from stepwatch.config import AgentConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=RANKS)
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # collective: every rank makes both
    mine = groups[rank // 2]
    torch.manual_seed(0)
    a = DDP(TinyGPT(CFG), bucket_cap_mb=0.01, process_group=mine)
    torch.manual_seed(0)
    b = DDP(TinyGPT(CFG), bucket_cap_mb=0.01, process_group=mine)
    agent = Stepwatch(
        AgentConfig(run="r", max_window_steps=8, send_interval_s=1e9, warmup_steps=0),
        detect({}, host="h"),
        convention=None,
        sender=MemorySink(),
    )
    agent.watch(b, per_bucket=True)  # the per-bucket hook does the reduction itself
    g = torch.Generator().manual_seed(rank)
    mismatches = 0
    for _ in range(2):
        x = torch.randint(1, CFG.vocab, (4, CFG.seq_len), generator=g)
        mismatches += _backward_both(a, b, x)
        agent.step(tokens=1)
    with open(out.format(rank=rank), "w") as f:
        json.dump({"mismatches": mismatches, "groups": [s["group"] for s in agent.comm_timing.groups()]}, f)
    agent.close()
    dist.barrier()
    dist.destroy_process_group()


def test_watching_a_ddp_on_a_subgroup_reduces_over_that_group(tmp_path: Path) -> None:
    """``sw.watch(ddp, per_bucket=True)`` on a DDP built over a data-parallel subgroup (tensor or pipeline
    parallelism beside it) all-reduces over that group, as DDP itself does: it registered
    its hook with no state, which reduced over the whole world and mixed the groups'
    gradients."""
    init = f"file://{tmp_path / 'store'}"
    out = str(tmp_path / "sub{rank}.json")
    gloo_ranks.spawn(_subgroup_worker, (init, out), RANKS)
    for r in range(RANKS):
        got = json.loads(Path(out.format(rank=r)).read_text())
        assert got["mismatches"] == 0, f"rank {r}: gradients differ from DDP's own on its group"
        assert "world" not in got["groups"], got["groups"]  # counted under the subgroup's name


def _reduction_worker(rank: int, init: str, out: str) -> None:
    """DDP with its built-in all-reduce, timed per step from autograd's final callbacks
    (``sw.watch``'s default), beside the same DDP untimed: one rank reaches one step's
    backward late, with no more work (a sleep between forward and backward)."""
    from stepwatch._ddp_timing import time_reduction

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=RANKS)
    pos = [1, 0]
    timing = CommTiming(16, lambda: (pos[0], pos[1]))
    torch.manual_seed(0)
    timed = DDP(TinyGPT(CFG), bucket_cap_mb=0.01)
    torch.manual_seed(0)
    plain = DDP(TinyGPT(CFG), bucket_cap_mb=0.01)
    installed = time_reduction(timed, timing)
    g = torch.Generator().manual_seed(rank)
    mismatches = 0
    steps = LATE_STEP + 2
    for step in range(steps):
        pos[1] = step
        x = torch.randint(1, CFG.vocab, (4, CFG.seq_len), generator=g)
        losses = [loss_fn(m(x), x, 0) for m in (plain, timed)]
        losses[0].backward()  # type: ignore[no-untyped-call]
        if step == LATE_STEP and rank == LATE_RANK:
            time.sleep(LATE_S)  # late to the all-reduce, with no extra work
        losses[1].backward()  # type: ignore[no-untyped-call]
        for pa, pb in zip(plain.parameters(), timed.parameters(), strict=True):
            assert pa.grad is not None and pb.grad is not None
            mismatches += int(not torch.equal(pa.grad, pb.grad))
            pa.grad = pb.grad = None
    pos[1] = steps  # a backward under no_sync reduces nothing: not timed, not counted
    with timed.no_sync():
        loss_fn(timed(x), x, 0).backward()  # type: ignore[no-untyped-call]
    slices = timing.take(steps + 1)
    assert slices is not None
    n = steps + 1
    section, _ = summarise(slices, 1, [1e6 * (i + 1) for i in range(n)], [1e6] * n, None)
    # One slot per step (the whole reduction): the arrival on the host clock, which is
    # the system's monotonic clock and so comparable across the ranks.
    arrived_s = list(slices.arrive[:n])
    with open(out.format(rank=rank), "w") as f:
        json.dump(
            {
                "installed": installed,
                "mismatches": mismatches,
                "seq": timing.groups(),
                "section": section,
                "arrived_s": arrived_s,
            },
            f,
        )
    dist.barrier()
    dist.destroy_process_group()


def test_the_builtin_reduction_is_timed_per_step_from_autograd_callbacks(tmp_path: Path) -> None:
    """The default timing leaves DDP's C++ all-reduce in place (a Python comm hook costs
    4-5% of the step on shared cores) and still tells the rank its peers waited for: its
    arrival callback runs before DDP's own end-of-backward callback (which waits for the
    all-reduces) and its end callback after it, so the late rank's sync is short and its
    peers' is the time they waited for it."""
    init = f"file://{tmp_path / 'store'}"
    out = str(tmp_path / "red{rank}.json")
    gloo_ranks.spawn(_reduction_worker, (init, out), RANKS)
    results = [json.loads(Path(out.format(rank=r)).read_text()) for r in range(RANKS)]
    steps = LATE_STEP + 2
    for r in results:
        assert r["installed"] is True and r["mismatches"] == 0
        sec = r["section"]
        # One slot per step: the whole reduction; none for the no_sync backward.
        assert sec["collectives"] == [], "no per-bucket durations without per-bucket timing"
        for k in ("arrive_us", "sync_us"):
            assert all(v is not None and v >= 0 for v in sec[k][:steps]) and sec[k][steps] is None, (k, sec)
        assert sec["cpu_us"][0] is None and all(v is not None and v > 0 for v in sec["cpu_us"][1:steps])
        (world,) = r["seq"]
        assert world["group"] == "world" and world["entered"] == world["completed"] == steps, world
    sync = [r["section"]["sync_us"][LATE_STEP] * 1e-6 for r in results]
    arrived = [r["arrived_s"][LATE_STEP] for r in results]
    # The late rank came last, by its sleep: at least against the first peer to arrive (on
    # a loaded machine a peer can itself lose the core for a while before its arrival, and
    # then it waits less: what it waited is measured below, not assumed).
    last, first = max(arrived), arrived.index(min(arrived))
    assert arrived[LATE_RANK] == last and last - arrived[first] >= 0.8 * LATE_S, (arrived, sync)
    assert sync[first] >= 0.8 * LATE_S > 0.5 * LATE_S > sync[LATE_RANK], (arrived, sync)
    # Each rank's sync is the time it waited for the last arrival: the end is not early (it
    # was taken back only by the thread's own work and run-queue time), nor later than the
    # all-reduce's tail allows (generous: on loaded cores gloo's own threads wait too).
    for r in range(RANKS):
        waited = last - arrived[r]
        assert 0.8 * waited <= sync[r] <= waited + LATE_S, (r, arrived, sync)


BUSY_S, SLEEP_S = 0.2, 0.1


def _busy_worker(rank: int, init: str, out: str) -> None:
    """One rank, DDP timed per step, and after DDP's finalisation, before the timing's end
    callback (a callback queued by a callback queued before the timing's: autograd runs
    them in that order), 0.2 s of the training thread's own work on step 1 and a 0.1 s
    sleep on step 2."""
    from torch.autograd import Variable

    from stepwatch._ddp_timing import time_reduction

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=1)
    pos = [1, 0]
    timing = CommTiming(4, lambda: (pos[0], pos[1]))
    torch.manual_seed(0)
    model = DDP(TinyGPT(CFG), bucket_cap_mb=0.01)
    queue = Variable._execution_engine.queue_callback

    def work() -> None:
        t = time.thread_time()
        while time.thread_time() - t < BUSY_S:
            pass

    def before(_p: Any) -> None:
        if pos[1] == 1:
            queue(lambda: queue(work))
        elif pos[1] == 2:
            queue(lambda: queue(lambda: time.sleep(SLEEP_S)))

    next(iter(model.parameters())).register_post_accumulate_grad_hook(before)
    assert time_reduction(model, timing)
    x = torch.randint(1, CFG.vocab, (2, CFG.seq_len))
    for step in range(4):
        pos[1] = step
        t0 = time.perf_counter()
        loss_fn(model(x), x, 0).backward()  # type: ignore[no-untyped-call]
        if step == 1:
            backward_s = time.perf_counter() - t0
    slices = timing.take(4)
    assert slices is not None
    section, _ = summarise(slices, 1, [1e6 * (i + 1) for i in range(4)], [1e6] * 4, None)
    sync = [None if v is None else v * 1e-6 for v in section["sync_us"]]
    Path(out).write_text(json.dumps({"sync": sync, "backward_s": backward_s}))
    dist.destroy_process_group()


def test_the_end_leaves_out_the_training_threads_own_work_after_the_reduction(tmp_path: Path) -> None:
    """The per-step end is read on the training thread after DDP's finalisation, which
    on loaded cores adds the thread's wake-up and the copy into the gradients to the
    collective's time: noise that hid a compute straggler. The end is taken back by the
    thread's CPU and run-queue time since the arrival, so 0.2 s of the thread's own work
    before the read does not count as time in the all-reduce; a 0.1 s sleep there (not
    the thread's work) still does, so the end is not simply put back at the arrival."""
    out = tmp_path / "busy.json"
    gloo_ranks.spawn(_busy_worker, (f"file://{tmp_path / 'store'}", str(out)), 1)
    got = json.loads(out.read_text())
    assert got["backward_s"] >= BUSY_S, got  # the work ran inside that backward
    sync = got["sync"]
    assert all(v is not None for v in sync), got
    assert sync[1] < 0.25 * BUSY_S, got
    assert sync[2] >= 0.8 * SLEEP_S, got


class _Broken(CommTiming):
    """Timing slots whose every record fails."""

    def arrive(self, group: str, bucket_index: int, nbytes: int, op: int = 0) -> tuple[int, int] | None:
        raise RuntimeError("arrive broke")


class _BrokenEnd(CommTiming):
    def done(self, token: tuple[int, int] | None, group: str, at: float | None = None) -> None:
        raise RuntimeError("done broke")


def _broken_worker(rank: int, init: str, out: str) -> None:
    from stepwatch._ddp_timing import time_reduction

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=1)
    finished = []
    for broken in (_Broken, _BrokenEnd):
        torch.manual_seed(0)
        model = DDP(TinyGPT(CFG), bucket_cap_mb=0.01)
        assert time_reduction(model, broken(4, lambda: (1, 0)))
        x = torch.randint(1, CFG.vocab, (2, CFG.seq_len))
        for _ in range(2):
            loss_fn(model(x), x, 0).backward()  # type: ignore[no-untyped-call]
        finished.append(all(p.grad is not None for p in model.parameters()))
    Path(out).write_text(json.dumps(finished))
    dist.destroy_process_group()


def test_a_failing_timing_never_raises_into_backward(tmp_path: Path) -> None:
    """The callbacks run inside ``loss.backward()``: a timing that fails at the arrival
    or at the end loses its timing, and the backward completes with every gradient."""
    out = tmp_path / "broken.json"
    gloo_ranks.spawn(_broken_worker, (f"file://{tmp_path / 'store'}", str(out)), 1)
    assert json.loads(out.read_text()) == [True, True]
