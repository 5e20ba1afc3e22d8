"""``sw.step()`` per call against Lightning's ``Throughput`` and a bare loop, same run.

Each call is timed on its own with ``perf_counter_ns`` and the cost of the two timer
reads (median of an empty timed call) is subtracted, so the figures are the per-step
cost a training loop pays. Three contenders, interleaved in rounds so that machine load
hits them alike:

* ``stepwatch``: the real agent, all features on (padded tokens, a profiler window
  scheduled so that its edge compare runs every step, windows packed every 1,024 steps
  and handed to a sender), the sender replaced by one that drops windows (the HTTP
  thread is not on the training thread's path);
* ``lightning``: ``lightning.fabric.utilities.throughput.Throughput`` doing ``update`` +
  ``compute`` per step, as its docs use it;
* ``bare``: a method that reads the clock and stores three numbers into preallocated
  arrays: the floor of any per-step recorder in Python.
"""

from __future__ import annotations

import statistics
import time
from array import array
from collections.abc import Callable
from typing import Any

N = 20_000
ROUNDS = 5
_ns = time.perf_counter_ns


class _DropSender:
    def __init__(self) -> None:
        from stepwatch._sender import SenderStats

        self.stats = SenderStats()
        self.windows = 0

    def submit(self, window: Any) -> None:
        self.windows += 1

    def pending(self) -> int:
        return 0

    def flush(self, timeout_s: float) -> bool:
        return True

    def close(self, timeout_s: float) -> bool:
        return True


class _Bare:
    def __init__(self, n: int) -> None:
        self.t = array("d", bytes(8 * n))
        self.w = array("d", bytes(8 * n))
        self.k = array("q", bytes(8 * n))
        self.i = 0
        self.last = time.perf_counter()

    def step(self, tokens: int) -> None:
        now = time.perf_counter()
        i = self.i
        self.t[i] = now - self.last
        self.w[i] = 0.0
        self.k[i] = tokens
        self.last = now
        self.i = i + 1 if i + 1 < len(self.t) else 0


def _stepwatch() -> tuple[Callable[[int], None], Callable[[], None]]:
    import stepwatch
    from stepwatch._env import detect
    from stepwatch.config import AgentConfig
    from stepwatch.profiler._window import ProfilerWindow

    cfg = AgentConfig(run="bench", warmup_steps=10, send_interval_s=3600.0)
    pw = ProfilerWindow(every=10**9, steps=2, budget=0.01, warmup_end=10)
    sw = stepwatch.Stepwatch(
        cfg, detect({}, host="bench"), convention=None, sender=_DropSender(), profiler=pw
    )  # type: ignore[arg-type]

    def step(i: int) -> None:
        sw.step(tokens=4096, padded_tokens=4608)

    return step, lambda: sw.close(0.1) and None


def _lightning() -> tuple[Callable[[int], None], Callable[[], None]]:
    from lightning.fabric.utilities.throughput import Throughput

    tp = Throughput(window_size=100)
    t0 = time.perf_counter()

    def step(i: int) -> None:
        tp.update(time=time.perf_counter() - t0, batches=i + 1, samples=(i + 1) * 8, lengths=(i + 1) * 4096)
        tp.compute()

    return step, lambda: None


def _bare() -> tuple[Callable[[int], None], Callable[[], None]]:
    b = _Bare(1024)

    def step(i: int) -> None:
        b.step(4096)

    return step, lambda: None


def _timed(step: Callable[[int], None], n: int, start: int) -> list[int]:
    out = [0] * n
    for j in range(n):
        t0 = _ns()
        step(start + j)
        out[j] = _ns() - t0
    return out


def _timer_cost() -> float:
    def nothing(i: int) -> None:
        return None

    return statistics.median(_timed(nothing, N, 0))


def run() -> dict[str, Any]:
    contenders = {"stepwatch": _stepwatch(), "lightning": _lightning(), "bare": _bare()}
    samples: dict[str, list[int]] = {k: [] for k in contenders}
    overhead = _timer_cost()
    for r in range(ROUNDS):
        for name, (step, _) in contenders.items():
            samples[name] += _timed(step, N, r * N)
    for _, close in contenders.values():
        close()
    out: dict[str, Any] = {"calls": N * ROUNDS, "timer_ns": overhead}
    for name, s in samples.items():
        net = [max(0.0, v - overhead) for v in s]
        out[name] = {"median_us": statistics.median(net) / 1000, "mean_us": statistics.fmean(net) / 1000}
    sw, lt = out["stepwatch"], out["lightning"]
    out["ratio_lightning_over_stepwatch"] = {
        "median": lt["median_us"] / sw["median_us"] if sw["median_us"] else None,
        "mean": lt["mean_us"] / sw["mean_us"] if sw["mean_us"] else None,
    }
    return out


def report(r: dict[str, Any]) -> list[str]:
    lines = [f"hot path: {r['calls']:,} calls each, timer cost {r['timer_ns']:.0f} ns subtracted"]
    for name in ("stepwatch", "lightning", "bare"):
        lines.append(f"  {name:<10} median {r[name]['median_us']:.3f} us   mean {r[name]['mean_us']:.3f} us")
    ratio = r["ratio_lightning_over_stepwatch"]
    lines.append(f"  lightning / stepwatch: median {ratio['median']:.1f}x, mean {ratio['mean']:.1f}x")
    sw = r["stepwatch"]
    ok = sw["median_us"] <= 1.0 and sw["mean_us"] <= 2.0 and (ratio["median"] or 0) >= 3
    lines.append(f"  budget (median <= 1 us, mean <= 2 us, >= 3x cheaper): {'met' if ok else 'NOT met'}")
    return lines
