"""A load generator for N simulated ranks, built on the agent's own payload code.

Each simulated rank closes windows the way the agent does (``stepwatch._window.Window``
turned into JSON by ``stepwatch._payload``), so the collector sees exactly what a fleet
of agents would send. Payloads are encoded ahead of time (that encoding is itself
measured: it is the agent-side cost per window) and then posted over plain keep-alive
HTTP/1.1 connections by a minimal asyncio client: a Python HTTP library tops out near
1,000 requests/s on one core, which would measure the client, not the collector.
"""

from __future__ import annotations

import asyncio
import random
import time
from array import array
from collections.abc import Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from stepwatch import wire
from stepwatch._env import Layout, RankInfo, coords_for
from stepwatch._payload import build_payload, encode, new_batch_id
from stepwatch._window import Window

CONVENTION = {
    "formula": "6N",
    "attention": None,
    "flops_per_token": 6 * 8.0e9,
    "hfu_flops_per_token": None,
    "dtype": "bf16",
    "device_name": "NVIDIA H100 80GB HBM3",
    "peak_flops": 989.4e12,
    "peak_source": "datasheet",
    "id": "6N/bf16/H100@989TFLOPs[datasheet]",
}


@dataclass
class Fleet:
    """N simulated ranks of one run, each sending windows of ``steps_per_window`` steps."""

    run: str
    ranks: int
    steps_per_window: int
    #: The agent closes a window every 10 s: by default a window is 10 s of steps.
    step_time_s: float = 0.0
    tokens_per_step: int = 4096 * 8
    seed: int = 0
    #: Each window also carries the ``comm`` section a DDP rank sends (``sw.watch(ddp)``,
    #: the default with a DDP model): per-step arrival, sync and CPU, the group counters,
    #: the run-queue wait and two connections' link timing.
    comm: bool = False
    #: The comm section of ``sw.watch(ddp, per_bucket=True)`` (opt-in): every gradient
    #: bucket timed by the comm hook, and a duration sketch of its all-reduces per window.
    per_bucket: bool = False
    _rank_dicts: list[dict[str, object]] = field(default_factory=list, init=False)
    _comm_template: dict[str, Any] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if not self.step_time_s:
            self.step_time_s = 10.0 / self.steps_per_window
        layout = Layout(dp=self.ranks)
        self._rank_dicts = [
            RankInfo(
                rank=r,
                local_rank=r % 8,
                world_size=self.ranks,
                host=f"node{r // 8:05d}",
                layout=layout,
                coords=coords_for(r, layout),
            ).to_dict()
            for r in range(self.ranks)
        ]
        if self.comm:
            self._comm_template = comm_template(self.steps_per_window, self.step_time_s, self.per_bucket)

    def payloads(self, windows: int, first_window: int = 0) -> Iterator[bytes]:
        """Encoded payloads, window-major: every rank's window k, then window k + 1, as a
        synchronous job produces them."""
        rng = random.Random(self.seed)
        n = self.steps_per_window
        agent = {"version": "0.1.0", "clock": "cuda_events", "dropped_windows": 0, "dropped_steps": 0}
        for k in range(first_window, first_window + windows):
            wall_end = 1.8e9 + (k + 1) * n * self.step_time_s
            for r in range(self.ranks):
                times = array("d", (self.step_time_s * (1 + 0.02 * rng.random()) for _ in range(n)))
                window = Window(
                    first_step=k * n + 1,
                    step_time_s=times,
                    data_wait_s=array("d", (0.001 * rng.random() for _ in range(n))),
                    tokens=array("q", [self.tokens_per_step] * n),
                    padded_tokens=None,
                    tags=None,
                    wall_end=wall_end,
                    batch_id=new_batch_id(),
                )
                payload = build_payload(
                    window,
                    run=self.run,
                    rank=self._rank_dicts[r],
                    convention=CONVENTION,
                    agent={**agent, "hot_path_mean_s": 4e-7},
                    sent_at=wall_end,
                    comm=self._comm(rng, times) if self.comm else None,
                )
                yield encode(payload)

    def _comm(self, rng: random.Random, times: Sequence[float]) -> dict[str, Any]:
        """The template's section with this rank-window's own per-step values."""
        return {
            **self._comm_template,
            "arrive_us": [round(t * 0.8e6 * (1 + 0.01 * rng.random())) for t in times],
            "sync_us": [round(2000 * rng.random()) for _ in times],
            "cpu_us": [round(t * 0.9e6 * (1 + 0.01 * rng.random())) for t in times],
            "runq_s": 0.002 * rng.random(),
            "links": [
                {"local": 1000 + k, "peer": 2000 + k, "bytes": 1 << 28, "received": 1 << 28, "busy_s": 0.4}
                for k in range(2)
            ],
        }

    def host_payloads(self, windows: int, ranks_per_host: int = 8) -> Iterator[bytes]:
        """The same windows as :meth:`payloads`, posted per host: one body per host and
        window carrying its ``ranks_per_host`` ranks' payloads (``wire.HOST_BATCH_PATH``),
        as the agent's host relay (``STEPWATCH_HOST_BATCH``) posts them."""
        pending: list[bytes] = []
        for body in self.payloads(windows):
            pending.append(body)
            if len(pending) == ranks_per_host:
                yield wire.host_batch(pending)
                pending = []
        if pending:
            yield wire.host_batch(pending)


def comm_template(
    steps: int, step_time_s: float, per_bucket: bool = False, buckets: int = 8
) -> dict[str, Any]:
    """A window's ``comm`` section as the agent's collective timing builds it (its own
    code): by default as ``sw.watch(ddp)`` times DDP's built-in reduction (``_ddp_timing``:
    one slot per step, no per-collective sketch); with ``per_bucket`` as the comm hook
    times ``buckets`` all-reduces per step, with their duration sketch."""
    from stepwatch._comm_timing import CommTiming

    pos = [1, 0]
    timing = CommTiming(steps, lambda: (pos[0], pos[1]))
    timing.per_bucket = per_bucket
    if not per_bucket:
        buckets = 1
    for i in range(steps):
        pos[1] = i
        for b in range(buckets):
            timing.done(timing.arrive("world", b, 4 << 20), "world")
    slices = timing.take(steps)
    assert slices is not None
    return timing.summarise(slices, 1, [step_time_s] * steps, perf_end=time.perf_counter())


def encoding_cost(fleet: Fleet, samples: int = 2000) -> float:
    """Median seconds to build and encode one window's payload (agent side, sender thread)."""
    gen = fleet.payloads(windows=max(1, samples // fleet.ranks + 1))
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        next(gen)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


@dataclass
class LoadResult:
    seconds: float
    statuses: dict[int, int]
    latencies_s: list[float]
    steps_acked: int

    @property
    def ok(self) -> int:
        return sum(n for s, n in self.statuses.items() if 200 <= s < 300)

    def quantile(self, q: float) -> float:
        xs = sorted(self.latencies_s)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


class _Conn:
    """One keep-alive HTTP/1.1 connection that POSTs JSON to the ingest endpoint."""

    def __init__(self, url: str, token: str | None, path: str = wire.INGEST_PATH) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        auth = f"Authorization: Bearer {token}\r\n" if token else ""
        self.head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{auth}"
            "Content-Type: application/json\r\nContent-Length: "
        ).encode()

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def post(self, body: bytes) -> int:
        self.writer.write(self.head + str(len(body)).encode() + b"\r\n\r\n" + body)
        status = int((await self.reader.readline()).split(b" ", 2)[1])
        length = 0
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        await self.reader.readexactly(length)
        return status

    def close(self) -> None:
        self.writer.close()


async def _post_all(
    url: str, bodies: Sequence[bytes], steps_per_body: int, concurrency: int, token: str | None, path: str
) -> LoadResult:
    statuses: dict[int, int] = {}
    latencies: list[float] = []
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        conn = _Conn(url, token, path)
        await conn.open()
        try:
            while next_index < len(bodies):
                body = bodies[next_index]
                next_index += 1
                t0 = time.perf_counter()
                status = await conn.post(body)
                latencies.append(time.perf_counter() - t0)
                statuses[status] = statuses.get(status, 0) + 1
        finally:
            conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    seconds = time.perf_counter() - t0
    ok = sum(n for s, n in statuses.items() if 200 <= s < 300)
    return LoadResult(seconds, statuses, latencies, ok * steps_per_body)


async def _post_at_rate(
    url: str,
    bodies: Sequence[bytes],
    steps_per_body: int,
    rate: float,
    connections: int,
    token: str | None,
    path: str,
) -> LoadResult:
    statuses: dict[int, int] = {}
    latencies: list[float] = []
    conns = [_Conn(url, token, path) for _ in range(connections)]
    await asyncio.gather(*(c.open() for c in conns))
    start = time.perf_counter() + 0.05

    async def worker(w: int) -> None:
        for i in range(w, len(bodies), connections):
            due = start + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            status = await conns[w].post(bodies[i])
            # From when it was due, not when it was sent: a slow server cannot hide
            # its queueing by slowing the client down (coordinated omission).
            latencies.append(time.perf_counter() - due)
            statuses[status] = statuses.get(status, 0) + 1

    await asyncio.gather(*(worker(w) for w in range(connections)))
    seconds = time.perf_counter() - start
    for c in conns:
        c.close()
    ok = sum(n for s, n in statuses.items() if 200 <= s < 300)
    return LoadResult(seconds, statuses, latencies, ok * steps_per_body)


def _run(coro: Coroutine[Any, Any, LoadResult]) -> LoadResult:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop comes with uvicorn[standard]
        return asyncio.run(coro)
    return uvloop.run(coro)


def post_all(
    url: str,
    bodies: Sequence[bytes],
    steps_per_body: int,
    *,
    concurrency: int = 64,
    token: str | None = None,
    path: str = wire.INGEST_PATH,
) -> LoadResult:
    """POST every body once over ``concurrency`` keep-alive connections, each sending its
    next body as soon as the previous one is answered (closed loop: the peak rate)."""
    return _run(_post_all(url, bodies, steps_per_body, concurrency, token, path))


def post_at_rate(
    url: str,
    bodies: Sequence[bytes],
    steps_per_body: int,
    *,
    rate: float,
    connections: int = 256,
    token: str | None = None,
    path: str = wire.INGEST_PATH,
) -> LoadResult:
    """POST the bodies at a fixed offered rate (open loop), spread over ``connections``;
    latency is measured from each request's due time."""
    return _run(_post_at_rate(url, bodies, steps_per_body, rate, connections, token, path))
