"""``make gpu-check``: prove stepwatch's CUDA path on a machine with a GPU, in minutes.

No line of the CUDA path can run in CI (no GPU there); its logic is unit-tested from
recorded and synthetic inputs (tests/unit/test_gpu_check.py tests the verdicts below,
tests/unit/test_trace_gpu.py the trace rules). This script runs the real thing and prints
one verdict line per check, ``PASS``/``FAIL``/``SKIP`` + name + the numbers:

``step_times``   CUDA-event step times (the agent's ``sw.step`` path and its sender-side
                 ``resolve``) against a reference the script measures itself: steps
                 bracketed by ``torch.cuda.synchronize()`` and ``perf_counter``; then the
                 same work without syncs, where the host runs ahead and only the events
                 can still see the device's steps (checked against the script's own
                 events at the same boundaries).
``ddp``          always-on timing of DDP over NCCL (``sw.watch(ddp_model)``: DDP's built-in
                 all-reduce timed per step from autograd's final callbacks): 2 GPUs with
                 rank 1 arriving late at every step (rank 0 must wait longer), or 1 GPU
                 with a lagging stream (the timing must not synchronise: the device is
                 still behind its host at every step after DDP's own first 10, which
                 synchronise); gradients equal to plain DDP's. "not available in this
                 build" where it is absent.
``ddp_device``   the same runs' ``comm`` sections: on the device clock (CUDA events
                 recorded at the step's arrival and end in the callbacks, read back by
                 the sender with ``query()``), and sane on every timed step:
                 0 <= arrival <= end <= the step's device time. Version 2 of the section
                 sends the end as arrival plus a sync clamped at 0, so an end recorded
                 before its arrival (a wrong stream) reads as a sync of 0: the verdict
                 counts those steps in its detail.
``first_step``   every step of a live trace (the agent's always-recording schedule), the
                 first included, against the script's own CUDA events at the same
                 boundaries, the host kept about a step ahead of the device.
``profiler_window`` the agent's own profiler window (its thread, export, parse, and the
                 entry a batch carries): parsed as CUDA, every step within 10% of the
                 agent's CUDA events, a matmul-only step mostly compute.
``nvml``         NVML fields of this GPU: UUID matching torch's, clocks, power,
                 temperature, throttle reasons.
``tokens``       the callbacks' token counter on CUDA masks: ``add`` returns while the
                 device is busy (no sync), and the deferred count is exact.

Without CUDA it says so and exits 0 having run nothing. Exit 1 when any check fails.
Run: ``make gpu-check`` (``GPU_PY=python make gpu-check`` to use your own environment);
``--keep DIR`` saves the first-step trace, its events and the DDP ranks' batches, as in
tests/fixtures/h200 (from an H200, where all eight verdicts of the six checks passed on
2026-12-04).
"""

from __future__ import annotations

import gzip
import itertools
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stepwatch._sender import MemorySink

KEEP_DIR: Path | None = None
"""Where ``--keep DIR`` saves what the checks measured (the first-step trace, the DDP
ranks' payloads), for tests pinned on real GPU data; None: nothing is saved."""


def _keep(name: str, data: str | bytes) -> None:
    if KEEP_DIR is None:
        return
    KEEP_DIR.mkdir(parents=True, exist_ok=True)
    path = KEEP_DIR / name
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data)


DDP_STEPS = 32
DDP_ASK_FROM = 13
"""The 1-GPU DDP check asks whether the device is behind from this step on: DDP's own
runtime statistics synchronise its first 10 iterations (the reducer's CUDA timer reads
its events with ``synchronize()`` while ``num_iterations_ <= 10``, and again every
100th), which an H200 showed as the host held to the device's pace until step 11."""

DDP_DELAY_S = 0.05
"""Host delay of the late rank before every backward (2-GPU DDP check)."""


@dataclass(frozen=True)
class Verdict:
    name: str
    status: str  # "PASS" | "FAIL" | "SKIP"
    detail: str

    def line(self) -> str:
        return f"{self.status} {self.name}: {self.detail}"


# -- verdicts: pure, unit-tested in CI --------------------------------------------------


def compare_step_times(
    measured: Sequence[float], reference: Sequence[float], *, rel: float = 0.03, abs_s: float = 2e-4
) -> Verdict:
    """Each measured step within ``rel`` (+ ``abs_s``) of its reference."""
    if len(measured) != len(reference) or not measured:
        return Verdict(
            "step_times", "FAIL", f"{len(measured)} steps measured, {len(reference)} in the reference"
        )
    worst = max(abs(m - r) / r if r > 0 else math.inf for m, r in zip(measured, reference, strict=True))
    bad = [
        i for i, (m, r) in enumerate(zip(measured, reference, strict=True)) if abs(m - r) > rel * r + abs_s
    ]
    ms = statistics.median(reference) * 1e3
    if bad:
        return Verdict(
            "step_times", "FAIL", f"{len(bad)} of {len(measured)} steps off the reference (worst {worst:.1%})"
        )
    return Verdict(
        "step_times",
        "PASS",
        f"{len(measured)} steps within {worst:.1%} of the synchronised reference ({ms:.2f} ms)",
    )


def compare_unsynced(
    event_s: Sequence[float], own_s: Sequence[float], host_s: Sequence[float], synced_s: float
) -> Verdict:
    """Without syncs: the agent's events still give the device's step, each within 2% (+
    20 µs) of the script's own CUDA events recorded at the same boundaries, while the
    host ran ahead (its median well below).

    The synchronised reference is shown, not compared: it holds, per step, the device's
    wait for the host's first launch after each sync (on an H200, 4 matmuls of 2048²
    took 1.46 ms synchronised and 1.37 ms back to back)."""
    if len(event_s) != len(own_s) or not event_s:
        return Verdict(
            "step_times_async", "FAIL", f"{len(event_s)} steps from the agent, {len(own_s)} from the script"
        )
    ev, own, host = statistics.median(event_s), statistics.median(own_s), statistics.median(host_s)
    bad = sum(abs(e - o) > 0.02 * o + 2e-5 for e, o in zip(event_s, own_s, strict=True))
    detail = (
        f"agent events {ev * 1e3:.3f} ms vs the script's {own * 1e3:.3f} ms "
        f"(synchronised {synced_s * 1e3:.2f} ms); host {host * 1e3:.2f} ms"
    )
    if bad:
        return Verdict("step_times_async", "FAIL", f"{bad} of {len(event_s)} steps off; {detail}")
    note = "host ran ahead" if host < 0.5 * ev else "host did not run ahead (launch-bound?)"
    return Verdict("step_times_async", "PASS", f"{detail} ({note})")


def first_step_verdict(step_s: Sequence[float], events_s: Sequence[float], before_window_s: float) -> Verdict:
    """Every step of the trace, the first included, within 10% of the CUDA events recorded
    at its boundaries (DESIGN §3: a device-side boundary is what such an event measures).
    The first step against the steady ones is shown for both, not compared: on a device
    that was idle when the profiler started, the events see the profiler's first launches
    too (on an H200, 2.38 ms against 2.05 steady)."""
    if len(step_s) < 3 or len(events_s) != len(step_s):
        return Verdict("first_step", "FAIL", f"{len(step_s)} steps parsed, {len(events_s)} timed")
    steady, ev_steady = statistics.median(step_s[1:]), statistics.median(events_s[1:])
    worst = max(abs(a - b) / b for a, b in zip(step_s, events_s, strict=True))
    detail = (
        f"first {step_s[0] * 1e3:.2f} ms (events {events_s[0] * 1e3:.2f}), steady {steady * 1e3:.2f} ms "
        f"(events {ev_steady * 1e3:.2f}); trace vs events worst {worst:.1%}; "
        f"{before_window_s * 1e3:.2f} ms of pre-window work set apart"
    )
    return Verdict("first_step", "PASS" if worst <= 0.10 else "FAIL", detail)


PROFILE_EVERY = 16
PROFILE_STEPS = 312
PROFILE_WINDOWS = 2
"""The profiler-window check: windows of 2 steps from step 17, over 312 steps of about
16 ms (not a multiple of the period: no window cut short by the agent's close). The
first ``start()`` in a process pays CUPTI's set-up on the training thread (3.2-4.1 s on
an H200), so the budget stretches the period after the first window (to 64 or 128 steps
there): the steps leave room for a second window, the second torch.profiler session of
the process, the kind an H200 returned empty with TEARDOWN_CUPTI=1."""


def profiler_window_verdict(
    entries: Sequence[Mapping[str, Any]], event_s: Mapping[int, float], want: int
) -> Verdict:
    """At least ``want`` windows and none skipped, each parsed on the device (``"device":
    "cuda"``: an H200 once gave a window without one kernel, parsed as CPU), every step's
    time within 10% of the agent's CUDA events for that step, and a matmul-only step mostly
    compute (at least 80%). The window's first step may be shorter than its events by what
    the profiler held the training thread (the trace sets its start apart; the events saw
    the device idle meanwhile): ``cost.on_thread_s`` at most; never longer (a tail of the
    step before the window counted in read 30 ms against 16 there)."""
    windows = [e for e in entries if not e.get("skipped")]
    skipped = [str(e["skipped"]) for e in entries if e.get("skipped")]
    if not windows:
        return Verdict("profiler_window", "FAIL", f"no window parsed; skipped: {skipped or 'none'}")
    problems: list[str] = []
    if len(windows) < want:
        problems.append(f"{len(windows)} of {want} windows parsed")
    if skipped:  # none is expected here: each lost window is a breakdown missing
        problems.append(f"{len(skipped)} skipped: {sorted(set(skipped))}")
    worst, shares = 0.0, []
    for e in windows:
        first = int(e["first_step"])
        if e.get("device") != "cuda":
            problems.append(f"window at {first} parsed as {e.get('device')!r}")
        start_s = float((e.get("cost") or {}).get("on_thread_s") or 0.0)
        for k, t in enumerate(e["time_s"]):
            ref = event_s.get(first + k)
            if ref is None or ref <= 0:
                problems.append(f"step {first + k} has no event time")
                continue
            # Shorter by the profiler's start at most (first step only); never longer.
            slack = start_s if k == 0 else 0.0
            off = (t - ref) / ref if t >= ref else max(0.0, ref - t - slack) / ref
            worst = max(worst, off)
            if off > 0.10:
                problems.append(f"step {first + k}: trace {t * 1e3:.2f} ms, events {ref * 1e3:.2f} ms")
            if k > 0:
                shares.append(e["compute_s"][k] / t if t > 0 else 0.0)
    low = [x for x in shares if x < 0.8]
    if low:
        problems.append(f"{len(low)} steps under 80% compute (lowest {min(low):.0%})")
    ratio = (windows[0].get("cost") or {}).get("overhead_ratio")
    detail = (
        f"{len(windows)} windows ({len(skipped)} skipped), steps within {worst:.1%} of the events, "
        f"compute {min(shares, default=0.0):.0%}+ of the steady steps; first window's cost "
        f"{'?' if ratio is None else f'{ratio:.1%}'} of its period"
    )
    if problems:
        return Verdict("profiler_window", "FAIL", "; ".join(problems[:3]) + f"; {detail}")
    return Verdict("profiler_window", "PASS", detail)


def nvml_verdict(sample: Mapping[str, Any] | None, torch_uuid: str | None) -> Verdict:
    if sample is None:
        return Verdict(
            "nvml", "FAIL", "NVML gave nothing (is nvidia-ml-py installed? pip install stepwatch[nvml])"
        )
    problems = []
    uuid = sample.get("gpu_uuid")
    if not uuid:
        problems.append("no UUID")
    elif torch_uuid and torch_uuid.removeprefix("GPU-") not in uuid:
        problems.append(f"UUID {uuid} is not torch's device {torch_uuid}")
    checks: list[tuple[str, Callable[[Any], bool]]] = [
        ("sm_clock_mhz", lambda v: v > 0),
        ("power_w", lambda v: v > 0),
        ("temperature_c", lambda v: 0 < v < 120),
    ]
    for key, good in checks:
        v = sample.get(key)
        if not isinstance(v, int | float) or not good(v):
            problems.append(f"{key}={v!r}")
    if not isinstance(sample.get("throttle_reasons"), list):
        problems.append("no throttle reasons list")
    fields = ", ".join(
        f"{k}={sample.get(k)!r}" for k in ("sm_clock_mhz", "power_w", "temperature_c", "throttle_reasons")
    )
    return Verdict(
        "nvml", "FAIL" if problems else "PASS", ("; ".join(problems) + " | " if problems else "") + fields
    )


def tokens_verdict(add_s: float, busy_s: float, got: int, want: int) -> Verdict:
    """``add`` took much less than the device's queued work, and the count is exact."""
    detail = (
        f"add() {add_s * 1e3:.2f} ms while the device was busy {busy_s * 1e3:.0f} ms; counted {got} of {want}"
    )
    ok = add_s < 0.25 * busy_s and got == want
    return Verdict("tokens", "PASS" if ok else "FAIL", detail)


def numbers_under(doc: Any, key_part: str) -> list[float]:
    """Every number found under a key containing ``key_part``, anywhere in ``doc``
    (the always-on section's layout belongs to the agent's timing; the check only needs
    its numbers)."""
    out: list[float] = []

    def walk(node: Any, hit: bool) -> None:
        if isinstance(node, Mapping):
            for k, v in node.items():
                walk(v, hit or key_part in str(k))
        elif isinstance(node, list | tuple):
            for v in node:
                walk(v, hit)
        elif hit and isinstance(node, int | float) and not isinstance(node, bool) and math.isfinite(node):
            out.append(float(node))

    walk(doc, False)
    return out


def ddp_lag_verdict(
    sync_by_rank: Mapping[int, Sequence[float]], delay_s: float, grads_equal: bool
) -> Verdict:
    """2 ranks, rank 1 late by ``delay_s``: rank 0's sync (end - last arrival) is longer by
    about the delay; the gradients are DDP's own."""
    if not all(sync_by_rank.get(r) for r in (0, 1)):
        return Verdict("ddp", "FAIL", f"no sync times in the payload for ranks {sorted(sync_by_rank)}")
    s0, s1 = statistics.median(sync_by_rank[0]), statistics.median(sync_by_rank[1])
    ok = s0 - s1 >= 0.5 * delay_s and grads_equal
    detail = (
        f"sync rank 0 {s0 * 1e3:.1f} ms, rank 1 (late by {delay_s * 1e3:.0f} ms) {s1 * 1e3:.1f} ms; "
        f"gradients {'equal to' if grads_equal else 'DIFFERENT from'} plain DDP's"
    )
    return Verdict("ddp", "PASS" if ok else "FAIL", detail)


def ddp_single_verdict(
    host_s: Sequence[float], device_s: Sequence[float], behind: int, asked: int, timed: int, grads_equal: bool
) -> Verdict:
    """1 GPU, lagging stream: the timing did not sync (the device was still behind its
    host at every step asked: ``behind`` of ``asked``), the steps were timed, and the
    gradients are DDP's own.

    Why not host time against device time: once the host is about a thousand launches
    ahead, CUDA's launch queue is full and every launch waits for the device, so the
    host's pace equals the device's with no sync anywhere (seen on an H200: host 25.06
    ms/step, device 26.29). What a sync changes is whether the device has caught up: at
    each step's start the check asks (``query()``) whether an event recorded two steps
    earlier has completed; after a sync in the step between, it always has."""
    host, dev = statistics.median(host_s), statistics.median(device_s)
    ok = asked > 0 and behind == asked and timed > 0 and grads_equal
    verdict = "no sync" if behind == asked else "SYNCED"
    detail = (
        f"device behind its host at {behind} of {asked} steps ({verdict}); "
        f"host {host * 1e3:.2f} ms/step, device {dev * 1e3:.2f} ms/step; "
        f"{timed} timing values in the payload; gradients {'equal' if grads_equal else 'DIFFERENT'}"
    )
    return Verdict("ddp", "PASS" if ok else "FAIL", detail + " (1 GPU: world of 1, lagging stream)")


DEVICE_TOL_S = 1e-5
"""Slack for the 1 µs rounding of the wire's seconds in ``ddp_device``."""


def arrival_and_end(comm: Mapping[str, Any]) -> tuple[list[float | None], list[float | None]]:
    """Per step, arrival and end in seconds from a ``comm`` section: version 2's integer
    microseconds (the end is arrival plus sync), or version 1's seconds."""
    if "arrive_us" in comm:
        arrive = [None if a is None else a * 1e-6 for a in comm["arrive_us"]]
        sync = [None if y is None else y * 1e-6 for y in comm.get("sync_us", [])]
        return arrive, [None if a is None or y is None else a + y for a, y in zip(arrive, sync, strict=False)]
    return list(comm.get("arrive_s", [])), list(comm.get("end_s", []))


def ddp_device_verdict(payloads: Sequence[Mapping[str, Any]]) -> Verdict:
    """The timing's sections on CUDA: every one on the device clock, and on every timed
    step 0 <= arrival <= end <= the step's time (all three from CUDA events: a device
    arrival after its end, or an all-reduce ending after its step, means an event was
    recorded on the wrong stream)."""
    clocks: set[str] = set()
    timed: list[tuple[float, float, float]] = []
    bad = zero = 0
    for doc in payloads:
        comm = doc.get("comm")
        if not isinstance(comm, Mapping) or not (comm.get("arrive_us") or comm.get("arrive_s")):
            continue
        clocks.add(str(comm.get("clock", "host")))
        times = doc.get("steps", {}).get("time_s", [])
        for a, e, t in zip(*arrival_and_end(comm), times, strict=False):
            if a is None or e is None:
                continue
            timed.append((a, e, t))
            zero += int(e == a)
            bad += int(not (0.0 <= a <= e + DEVICE_TOL_S and e <= t + DEVICE_TOL_S))
    if not timed:
        return Verdict("ddp_device", "FAIL", f"no timed step in {len(payloads)} payload(s)")
    if clocks != {"device"}:
        return Verdict(
            "ddp_device", "FAIL", f"sections on the {'/'.join(sorted(clocks))} clock, not the device's"
        )
    a, e, t = (statistics.median(x[i] for x in timed) * 1e3 for i in range(3))
    detail = (
        f"{len(timed)} steps on the device clock, median arrival {a:.2f} ms <= end {e:.2f} ms "
        f"<= step {t:.2f} ms; {zero} with a sync of 0 (an end before its arrival reads so)"
    )
    if bad:
        return Verdict(
            "ddp_device", "FAIL", f"{bad} of {len(timed)} steps not arrival <= end <= step; {detail}"
        )
    return Verdict("ddp_device", "PASS", detail)


# -- measurements: need CUDA ------------------------------------------------------------


def _agent(steps: int, *, rank: int = 0, world: int = 1, profile_every: int = 0) -> tuple[Any, MemorySink]:
    """The agent as ``init`` builds it on a CUDA rank, its windows kept in memory; with
    ``profile_every``, its profiler window too (2 steps per window, a budget of 100% of
    the period: stretched only by a window that costs more than its period)."""
    import stepwatch
    from stepwatch._api import _profiler
    from stepwatch._device_clock import cuda_clock
    from stepwatch._env import detect
    from stepwatch._sender import MemorySink
    from stepwatch.config import AgentConfig

    rec = MemorySink()
    cfg = AgentConfig(
        run="gpu-check",
        send_interval_s=1e9,
        warmup_steps=0,
        max_window_steps=max(steps, 16),
        profile_every=profile_every,
        profile_steps=2,
        profile_budget=1.0,
    )
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)}
    info = detect(env, host="gpu-check")
    clock = cuda_clock(cfg.max_window_steps)
    if clock is None:
        raise RuntimeError("the agent found no initialised CUDA context")
    sw = stepwatch.Stepwatch(
        cfg,
        info,
        convention=None,
        sender=rec,
        device_clock=clock,  # type: ignore[arg-type]
        profiler=_profiler(cfg, info, start_step=0, cuda=True) if profile_every else None,
    )
    return sw, rec


def _event_times(sw: Any, rec: MemorySink) -> list[float]:
    from stepwatch._device_clock import CudaEventClock

    sw.close(10.0)
    out: list[float] = []
    for w in rec.windows:
        if w.device_events is not None:
            prev, events = w.device_events
            out.extend(CudaEventClock.resolve(prev, events, w.step_time_s, deadline_s=30.0))
        elif w.n_steps:  # the sink holds every window unread: more than the clock's generations
            raise RuntimeError(
                f"a window of {w.n_steps} steps has no device events: the check closed too many windows"
            )
    return out


def check_step_times() -> list[Verdict]:
    import torch

    a = torch.randn(2048, 2048, device="cuda")
    sizes = [2, 4, 6] * 8

    def work(k: int) -> None:
        for _ in range(k):
            a.matmul(a)

    for _ in range(3):
        work(4)
    torch.cuda.synchronize()
    sw, rec = _agent(len(sizes))
    ref: list[float] = []
    t = time.perf_counter()
    sw.step(tokens=1)  # the boundary before the first timed step
    for k in sizes:
        work(k)
        torch.cuda.synchronize()
        now = time.perf_counter()
        ref.append(now - t)
        t = now
        sw.step(tokens=1)
    ev = _event_times(sw, rec)[1:]
    out = [compare_step_times(ev, ref)]
    by_size = {k: statistics.median(r for r, s in zip(ref, sizes, strict=True) if s == k) for k in set(sizes)}
    sw, rec = _agent(len(sizes))
    host: list[float] = []
    own: list[Any] = []  # the script's events, recorded right after the agent's
    t = time.perf_counter()
    sw.step(tokens=1)
    own.append(torch.cuda.Event(enable_timing=True))
    own[-1].record()
    for k in [4] * len(sizes):
        work(k)
        now = time.perf_counter()
        host.append(now - t)
        t = now
        sw.step(tokens=1)
        own.append(torch.cuda.Event(enable_timing=True))
        own[-1].record()
    torch.cuda.synchronize()
    own_s = [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(own)]
    ev = _event_times(sw, rec)[2:]
    out.append(compare_unsynced(ev, own_s[1:], host[1:], by_size[4]))
    return out


def _ddp_model(device: Any) -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(8))).to(device)


def _ddp_worker(rank: int, world: int, init_file: str, out_dir: str, delay_s: float, lag_cycles: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    dev = torch.device("cuda", rank)
    plain, watched = DDP(_ddp_model(dev), device_ids=[rank]), DDP(_ddp_model(dev), device_ids=[rank])
    x = torch.randn(64, 1024, device=dev, generator=torch.Generator(dev).manual_seed(rank))
    plain(x).square().mean().backward()
    sw, rec = _agent(DDP_STEPS, rank=rank, world=world)
    sw.watch(watched)
    host: list[float] = []
    marks: list[Any] = []  # an event at each step's end
    lagging: list[bool] = []  # from step 2: did it begin with the device two steps behind?
    t = time.perf_counter()
    for step in range(DDP_STEPS):
        if step >= 2:
            lagging.append(not marks[step - 2].query())
        watched.zero_grad()  # no optimizer: the last step's gradients are comparable with plain's
        loss = watched(x).square().mean()
        if delay_s and rank == 1:
            time.sleep(delay_s)
        if lag_cycles:
            torch.cuda._sleep(lag_cycles)  # the stream lags its host
        loss.backward()
        now = time.perf_counter()
        host.append(now - t)
        t = now
        sw.step(tokens=64)
        marks.append(torch.cuda.Event())
        marks[-1].record()
    torch.cuda.synchronize()
    equal = all(
        torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), watched.parameters(), strict=True)
    )
    device = _event_times(sw, rec)  # closes the agent: its last window holds the steps
    windows = list(rec.windows)
    docs = [json.loads(sw._encode(w, rec.stats)) for w in windows]
    result = {
        "rank": rank,
        "equal": equal,
        "host": host[DDP_ASK_FROM:],
        "device": device[DDP_ASK_FROM:],
        "behind": sum(lagging[DDP_ASK_FROM - 2 :]),
        "asked": DDP_STEPS - DDP_ASK_FROM,
        "lagging": lagging,
        "payloads": docs,
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def check_ddp() -> list[Verdict]:
    import torch
    import torch.multiprocessing as mp

    import stepwatch

    if not hasattr(stepwatch, "comm_hook") or not hasattr(stepwatch.Stepwatch, "watch"):
        return [
            Verdict("ddp", "SKIP", "not available in this build (no stepwatch.comm_hook / Stepwatch.watch)")
        ]
    if not torch.distributed.is_nccl_available():
        return [Verdict("ddp", "SKIP", "this torch build has no NCCL")]
    world = 2 if torch.cuda.device_count() >= 2 else 1
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        delay, cycles = (DDP_DELAY_S, 0) if world == 2 else (0.0, 50_000_000)
        mp.spawn(_ddp_worker, args=(world, init, tmp, delay, cycles), nprocs=world, join=True)
        results = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
    _keep("ddp.json", json.dumps(results))
    equal = all(r["equal"] for r in results)
    device = ddp_device_verdict([doc for r in results for doc in r["payloads"]])
    if world == 2:
        sync = {r["rank"]: [v * 1e-6 for v in numbers_under(r["payloads"], "sync_us")] for r in results}
        return [ddp_lag_verdict(sync, DDP_DELAY_S, equal), device]
    (r,) = results
    timed = len(numbers_under(r["payloads"], "comm"))
    return [ddp_single_verdict(r["host"], r["device"], r["behind"], r["asked"], timed, equal), device]


def check_first_step() -> list[Verdict]:
    """About one step of GPU lag: each step waits for the step before the previous one."""
    import torch
    from torch.profiler import ProfilerAction, ProfilerActivity, profile

    from stepwatch.profiler.chrome import trace_from_profiler
    from stepwatch.profiler.trace import parse_chrome_trace, window_breakdown

    # 6 products of 4096² in fp32 (about 16 ms on an H200), the host a step ahead. On an
    # H200 the device had drained the step before the window by its first launch all the
    # same (the profiler's start held the host 3 ms and more): this check sees the
    # profiler's start set apart; a tail the trace does not hold is the profiler_window
    # check's later windows.
    a = torch.randn(4096, 4096, device="cuda")
    n = 6
    done: list[Any] = []
    starts: list[Any] = []

    def step() -> None:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        starts.append(ev)
        for _ in range(6):
            a.matmul(a)
        if len(starts) >= 2:
            starts[-2].synchronize()  # the host stays about one step ahead
        done.append(ev)

    for _ in range(4):
        step()
    prof = profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], schedule=lambda _s: ProfilerAction.RECORD
    )
    prof.start()
    first = len(starts)
    for _ in range(n):
        step()
        prof.step()
    end = torch.cuda.Event(enable_timing=True)
    end.record()
    prof.stop()
    torch.cuda.synchronize()
    marks = [*starts[first + 1 : first + n], end]
    events_s = [starts[first + i].elapsed_time(marks[i]) / 1e3 for i in range(n)]
    trace = trace_from_profiler(prof)
    _keep("first_step_trace.json.gz", gzip.compress(json.dumps(trace).encode()))
    _keep("first_step_events.json", json.dumps({"events_s": events_s}))
    w = parse_chrome_trace(trace)
    steps = [b.step_s for b in window_breakdown(w)]
    k = min(len(steps), n)
    return [first_step_verdict(steps[:k], events_s[:k], w.before_window_us * 1e-6)]


def _profiler_worker(_rank: int, out_dir: str) -> None:
    """The agent with its profiler window on, in a process of its own (as in training:
    no other torch.profiler session before it)."""
    import torch

    a = torch.randn(4096, 4096, device="cuda")
    marks: list[Any] = []

    def step() -> None:
        for _ in range(6):
            a.matmul(a)
        marks.append(torch.cuda.Event())
        marks[-1].record()
        if len(marks) >= 2:
            marks[-2].synchronize()  # the host stays about one step ahead

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    sw, rec = _agent(PROFILE_STEPS + 8, profile_every=PROFILE_EVERY)
    entries: list[dict[str, Any]] = []
    sw.step(tokens=1)  # the boundary before the first timed step
    for i in range(PROFILE_STEPS):
        step()
        sw.step(tokens=1)
        if i % 8 == 7:  # as the sender does at each send: the agent keeps 8 entries at most
            entries.extend(sw._pw.take())
    event_s = _event_times(sw, rec)  # closes the agent, which lets the parsing finish
    entries += [e for w in rec.windows for e in json.loads(sw._encode(w, rec.stats)).get("profiles") or []]
    Path(out_dir, "profiler.json").write_text(json.dumps({"entries": entries, "event_s": event_s}))


def check_profiler_window() -> list[Verdict]:
    """The agent's own profiler window on CUDA: torch.profiler started and stopped at its
    step edges, the trace exported and parsed on its thread, the entry the batch carries."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_profiler_worker, args=(tmp,), nprocs=1, join=True)
        got = json.loads(Path(tmp, "profiler.json").read_text())
    _keep("profiler_window.json", json.dumps(got))
    # event_s[i] is step i + 1's (the agent numbers steps from 1)
    steps = {i + 1: t for i, t in enumerate(got["event_s"])}
    return [profiler_window_verdict(got["entries"], steps, PROFILE_WINDOWS)]


def check_nvml() -> list[Verdict]:
    import torch

    from stepwatch._nvml import for_current_cuda_device

    uuid = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "uuid", None)
    return [nvml_verdict(for_current_cuda_device().sample(), None if uuid is None else str(uuid))]


def check_tokens() -> list[Verdict]:
    import torch

    from stepwatch.integrations._tokens import TokenCounter

    counter = TokenCounter()
    masks = [(torch.rand(8, 512, device="cuda") > 0.3).long() for _ in range(4)]
    want = int(sum(int(m.sum().item()) for m in masks))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(200_000_000)  # keep the device busy for a while (~0.1-0.2 s)
    a0 = time.perf_counter()
    for m in masks:
        counter.add({"attention_mask": m})
    add_s = time.perf_counter() - a0
    torch.cuda.synchronize()
    busy_s = time.perf_counter() - t0
    got = 0
    deadline = time.monotonic() + 5
    while got < want and time.monotonic() < deadline:  # take() hands over completed counts
        tokens, _ = counter.take()
        got += tokens
    return [tokens_verdict(add_s, busy_s, got, want)]


CHECKS: tuple[tuple[str, Callable[[], list[Verdict]]], ...] = (
    ("step_times", check_step_times),
    ("ddp", check_ddp),
    ("first_step", check_first_step),
    ("profiler_window", check_profiler_window),
    ("nvml", check_nvml),
    ("tokens", check_tokens),
)


def run(checks: Iterable[tuple[str, Callable[[], list[Verdict]]]] = CHECKS) -> list[Verdict]:
    out: list[Verdict] = []
    for name, fn in checks:
        t0 = time.perf_counter()
        try:
            got = fn()
        except Exception as exc:
            tb = traceback.format_exception_only(type(exc), exc)[-1].strip()
            got = [Verdict(name, "FAIL", f"error: {tb}")]
        for v in got:
            print(f"{v.line()}  [{time.perf_counter() - t0:.1f} s]", flush=True)
        out.extend(got)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    global KEEP_DIR
    parser = argparse.ArgumentParser(description="Check stepwatch's CUDA path on this machine's GPU.")
    parser.add_argument("--keep", metavar="DIR", type=Path, help="save what the checks measured here")
    parser.add_argument(
        "--only", metavar="NAME", action="append", choices=[n for n, _ in CHECKS], help="run this check only"
    )
    args = parser.parse_args(argv)
    KEEP_DIR = args.keep
    try:
        import torch
    except ImportError:
        print("gpu-check: torch is not installed: nothing checked")
        return 0
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device here: nothing checked (run it on a machine with a GPU)")
        return 0
    name = torch.cuda.get_device_name()
    print(
        f"gpu-check on {torch.cuda.device_count()} x {name}, "
        f"torch {torch.__version__}, CUDA {torch.version.cuda}"
    )
    verdicts = run([c for c in CHECKS if not args.only or c[0] in args.only])
    failed = [v for v in verdicts if v.status == "FAIL"]
    print(f"gpu-check: {len(verdicts) - len(failed)} passed or skipped, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
