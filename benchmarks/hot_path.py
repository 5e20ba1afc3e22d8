"""``sw.step()`` per call against the floor and Lightning's ``Throughput``, same run.

Each call is timed on its own with ``perf_counter_ns`` and the cost of the two timer
reads (median of an empty timed call) is subtracted, so the figures are the per-step
cost a training loop pays. The contenders (and the empty call) are interleaved call by
call, in a rotating order, so that a change of the machine's speed hits them alike: timed
in blocks of 20,000 calls each, three runs on the shared machine gave the floor's median
0.21-0.41 us and stepwatch's ratio to it 0.78x-2.36x. Three contenders:

* ``stepwatch``: the real agent, all features on (padded tokens, a profiler window
  scheduled so that its edge compare runs every step, windows packed every 1,024 steps)
  with its real sender posting them to a real collector on loopback (``stepwatch
  serve`` over SQLite): the sender thread, started at ``init``, competes for the GIL as
  it does in training;
* ``lightning``: ``lightning.fabric.utilities.throughput.Throughput`` doing ``update`` +
  ``compute`` per step, as its docs use it;
* ``bare``: a method that reads the clock and stores three numbers into preallocated
  arrays: the floor of any per-step recorder in Python.

Two settings: a tight loop (warm caches: the best case) and *cache-cold*, each call after
a pass over 8 MB of numpy data (as a training step evicts the caches between two calls).
The steps that closed a window (every 1,024th) are reported on their own.
Budget: tight-loop median <= 1.3x the floor (the median of the rounds' ratios, each
round's medians taken over the same interleaved stretch; the rounds' range is printed
as the noise band) and <= 1 us, >= 3x cheaper than Lightning.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import tempfile
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

N = 20_000
ROUNDS = 5
COLD_N = 2_000
COLD_BYTES = 8 << 20
WINDOW = 1024
FLOOR_BUDGET = 1.3
_ns = time.perf_counter_ns


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


def _stepwatch(url: str) -> tuple[Callable[[int], None], Callable[[], None]]:
    import stepwatch
    from stepwatch._env import detect
    from stepwatch.config import AgentConfig
    from stepwatch.profiler._window import ProfilerWindow

    cfg = AgentConfig(run="bench", url=url, warmup_steps=10, send_interval_s=3600.0, max_window_steps=WINDOW)
    pw = ProfilerWindow(every=10**9, steps=2, budget=0.01, warmup_end=10)
    sw = stepwatch.Stepwatch(cfg, detect({}, host="bench"), convention=None, profiler=pw)

    def step(i: int) -> None:
        sw.step(tokens=4096, padded_tokens=4608)

    return step, lambda: sw.close(30.0) and None


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


def _nothing(i: int) -> None:
    return None


def _timed(steps: Sequence[Callable[[int], None]], n: int, start: int, buf: Any = None) -> list[list[int]]:
    """Call ``j`` of every contender right after the others' (the order rotating), each
    timed on its own; with ``buf``, each call after a pass over it (reads and writes every
    cache line of it: cache-cold)."""
    k = len(steps)
    out = [[0] * n for _ in range(k)]
    for j in range(n):
        for o in range(k):
            c = (j + o) % k
            if buf is not None:
                np.multiply(buf, 1.0, out=buf)
            step, times = steps[c], out[c]
            t0 = _ns()
            step(start + j)
            times[j] = _ns() - t0
    return out


@contextlib.contextmanager
def _collector() -> Iterator[str]:
    from stepwatch.demo import launch

    with tempfile.TemporaryDirectory(prefix="stepwatch-bench-") as d:
        db = f"sqlite:///{Path(d) / 'bench.db'}"
        with launch.collector(db, log_path=str(Path(d) / "collector.log"), ready_timeout_s=180.0) as col:
            yield col.url


def _summary(s: list[int], overhead: float) -> dict[str, float]:
    net = [max(0.0, v - overhead) for v in s]
    return {"median_us": statistics.median(net) / 1000, "mean_us": statistics.fmean(net) / 1000}


def _floor_ratio(sw: list[int], bare: list[int], timer: list[int]) -> float:
    """Stepwatch's net median over the floor's, both net of the same stretch's timer cost."""
    overhead = statistics.median(timer)
    floor = _summary(bare, overhead)["median_us"]
    return _summary(sw, overhead)["median_us"] / floor if floor else math.inf


def run() -> dict[str, Any]:
    with _collector() as url:
        contenders = {"stepwatch": _stepwatch(url), "lightning": _lightning(), "bare": _bare()}
        steps = [step for step, _ in contenders.values()] + [_nothing]
        warm: dict[str, list[int]] = {k: [] for k in [*contenders, "timer"]}
        cold: dict[str, list[int]] = {k: [] for k in [*contenders, "timer"]}
        rounds: list[float] = []
        buf = np.ones(COLD_BYTES // 8)
        calls = 0
        for _ in range(ROUNDS):
            tight = dict(zip(warm, _timed(steps, N, calls), strict=True))
            for name, times in zip(cold, _timed(steps, COLD_N, calls + N, buf), strict=True):
                cold[name] += times
            for name, times in tight.items():
                warm[name] += times
            rounds.append(_floor_ratio(tight["stepwatch"], tight["bare"], tight["timer"]))
            calls += N + COLD_N
        for _, close in contenders.values():
            close()
    overhead = statistics.median(warm["timer"])
    # The stepwatch calls that closed a window: call k (from 0) closes when (k + 1) % WINDOW == 0.
    seq = []
    for r in range(ROUNDS):
        seq += warm["stepwatch"][r * N : (r + 1) * N] + cold["stepwatch"][r * COLD_N : (r + 1) * COLD_N]
    closing = [max(0.0, v - overhead) / 1000 for k, v in enumerate(seq) if (k + 1) % WINDOW == 0]
    out: dict[str, Any] = {"calls": N * ROUNDS, "cold_calls": COLD_N * ROUNDS, "timer_ns": overhead}
    for name in contenders:
        out[name] = _summary(warm[name], overhead)
        out[f"{name}_cold"] = _summary(cold[name], statistics.median(cold["timer"]))
    out["closing_us"] = {"n": len(closing), "median": statistics.median(closing), "max": max(closing)}
    sw, lt = out["stepwatch"], out["lightning"]
    out["ratio_lightning_over_stepwatch"] = {
        "median": lt["median_us"] / sw["median_us"] if sw["median_us"] else None,
        "mean": lt["mean_us"] / sw["mean_us"] if sw["mean_us"] else None,
    }
    out["ratio_over_floor"] = statistics.median(rounds)
    out["ratio_over_floor_rounds"] = (min(rounds), max(rounds))
    cold_bare = out["bare_cold"]["median_us"]
    out["cold_ratio_over_floor"] = out["stepwatch_cold"]["median_us"] / cold_bare if cold_bare else None
    return out


def report(r: dict[str, Any]) -> list[str]:
    lines = [
        f"hot path: {r['calls']:,} tight-loop and {r['cold_calls']:,} cache-cold calls each "
        f"(cold: after a pass over {COLD_BYTES >> 20} MB), timer cost {r['timer_ns']:.0f} ns subtracted"
    ]
    for name in ("stepwatch", "lightning", "bare"):
        w, c = r[name], r[f"{name}_cold"]
        lines.append(
            f"  {name:<10} tight median {w['median_us']:.3f} us  mean {w['mean_us']:.3f} us   "
            f"cold median {c['median_us']:.3f} us  mean {c['mean_us']:.3f} us"
        )
    ratio = r["ratio_lightning_over_stepwatch"]
    lines.append(f"  lightning / stepwatch: median {ratio['median']:.1f}x, mean {ratio['mean']:.1f}x")
    floor, cold = r["ratio_over_floor"] or 0.0, r["cold_ratio_over_floor"] or 0.0
    lo, hi = r.get("ratio_over_floor_rounds", (floor, floor))
    lines.append(
        f"  stepwatch / floor (bare): tight median {floor:.2f}x (median of {ROUNDS} rounds, "
        f"range {lo:.2f}-{hi:.2f}x), cold median {cold:.2f}x"
    )
    c = r["closing_us"]
    lines.append(
        f"  window-closing calls ({c['n']}, real sender to a loopback collector): "
        f"median {c['median']:.1f} us, max {c['max']:.1f} us"
    )
    sw = r["stepwatch"]
    ok = sw["median_us"] <= 1.0 and sw["mean_us"] <= 2.0 and (ratio["median"] or 0) >= 3
    lines.append(f"  budget (median <= 1 us, mean <= 2 us, >= 3x cheaper): {'met' if ok else 'NOT met'}")
    lines.append(
        f"  budget (tight median <= {FLOOR_BUDGET}x the floor): "
        f"{'met' if floor <= FLOOR_BUDGET else 'NOT met'} ({floor:.2f}x)"
    )
    return lines
