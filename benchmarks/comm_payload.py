"""What the always-on collective timing adds to the wire and to the database, per
rank-window: bytes of real window payloads with and without their ``comm`` section, and
bytes of the rows that section makes the collector store, on PostgreSQL.

    python -m benchmarks.comm_payload [--steps 48] [--send-interval 4]

Why measured, not computed: the section's size depends on the values the hook really
records (digits of each rounded time), on the gloo connections the link sampler finds
and on the collector's rows; so 4 gloo ranks train the demo's tiny GPT (10 DDP buckets)
with the real agent (``stepwatch.init`` + ``sw.watch``), whose sender posts every
window to a loopback endpoint that keeps the bodies. The
bodies are then re-encoded with the agent's own ``encode`` without ``comm`` (the
difference is the section's bytes), and both sets are stored by the collector's
``Ingestor`` into two fresh PostgreSQL databases, where ``pg_column_size`` gives each
table's bytes per row.

Budgets (issue 11): payload growth <= 2 KiB per rank-window; storage growth <= 64 bytes
per rank-window row. The comm section's per-step arrays grow with the steps a window
holds, so the report gives bytes per step and what a rank-window of the collector's
usual sizes (64 and 1024 steps) then carries.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

RANKS = 4
#: The comm section's per-step lists, of either wire version (``wire.COMM_VERSION``).
PER_STEP = (
    *("arrive_us", "sync_us", "cpu_us", "broadcast_us"),
    *("arrive_s", "end_s", "sync_s", "cpu_s", "broadcast_s"),
)
PAYLOAD_BUDGET = 2048
ROW_BUDGET = 64
#: Steps per stored window: the collector picks a power of two near 10 s of steps.
WINDOW_SIZES = (64, 1024)


class _Sink:
    """A loopback HTTP endpoint that answers 200 to every POST and keeps the bodies: the
    agent sends exactly what it would send a collector (its own sender and encoder)."""

    def __init__(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        bodies: list[bytes] = []
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                with lock:
                    bodies.append(body)
                self.send_response(200)
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: Any) -> None:
                pass

        self.bodies = bodies
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> _Sink:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def _worker(rank: int, init: str, url: str, steps: int, send_interval: float) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import stepwatch
    from stepwatch.demo.model import GPTConfig, TinyGPT, loss_fn

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=RANKS)
    cfg = GPTConfig()
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    ddp = DDP(model, bucket_cap_mb=0.05)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-4)
    sw = stepwatch.init(
        run="comm-payload",
        model=model,
        seq_len=cfg.seq_len,
        dtype="fp32",
        peak_flops=5e10,
        url=url,
        rank=rank,
        local_rank=rank,
        world_size=RANKS,
        send_interval_s=send_interval,
        warmup_steps=2,
        profile_every=0,
    )
    sw.watch(ddp)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x = torch.randint(1, cfg.vocab, (8, cfg.seq_len), generator=g)
        loss_fn(ddp(x), x, 0).backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad(set_to_none=True)
        sw.step(tokens=x.numel())
    sw.close(timeout_s=10.0)
    dist.barrier()
    dist.destroy_process_group()


def record(steps: int, send_interval: float) -> list[dict[str, Any]]:
    """Every window body with steps and a ``comm`` section that the 4 ranks' agents sent."""
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp, _Sink() as sink:
        init = f"file://{Path(tmp) / 'store'}"
        mp.spawn(_worker, args=(init, sink.url, steps, send_interval), nprocs=RANKS, join=True)
        bodies = [json.loads(b) for b in sink.bodies]
    return [p for p in bodies if p["steps"]["time_s"] and p.get("comm")]


def payload_bytes(windows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Bytes of each window body with and without ``comm``, with the agent's encoder."""
    from stepwatch._payload import encode

    with_comm = [len(encode(p)) for p in windows]
    without = [len(encode({k: v for k, v in p.items() if k != "comm"})) for p in windows]
    steps = [len(p["steps"]["time_s"]) for p in windows]
    growth = [a - b for a, b in zip(with_comm, without, strict=True)]
    # The per-step arrays (arrival, sync, cpu and the broadcast's wait: one value per step
    # each; version 1 also had the end) apart from the per-window rest (their keys, duration
    # sketch, group counters, links, run-queue wait).
    per_step_bytes = [
        len(encode(p["comm"])) - len(encode({**p["comm"], **{k: [] for k in PER_STEP if k in p["comm"]}}))
        for p in windows
    ]
    slope = sum(per_step_bytes) / sum(steps)
    fixed = statistics.fmean(g - b for g, b in zip(growth, per_step_bytes, strict=True))
    return {
        "windows": len(windows),
        "steps": statistics.fmean(steps),
        "with": statistics.fmean(with_comm),
        "without": statistics.fmean(without),
        "growth": statistics.fmean(growth),
        "per_step": slope,
        "fixed": fixed,
    }


def _stored(
    url: str, windows: Sequence[Mapping[str, Any]], window_steps: int
) -> dict[str, tuple[int, float]]:
    """Store the bodies with the collector's ingest path; per table, (rows, mean bytes per
    row by ``pg_column_size``)."""
    import psycopg

    from stepwatch_server.ingest.store import Ingestor
    from stepwatch_server.schemas.ingest import IngestPayload
    from stepwatch_server.storage.backend import open_storage
    from stepwatch_server.storage.engine import make_engine

    engine = make_engine(url)
    try:
        ingestor = Ingestor(open_storage(engine), window_steps=window_steps)
        ingestor.store_many([IngestPayload.model_validate(p) for p in windows])
    finally:
        engine.dispose()
    out = {}
    with psycopg.connect(url.replace("+psycopg", "")) as conn:
        for table in ("rank_windows", "step_timings", "rank_groups", "link_samples"):
            n, size = conn.execute(
                f"SELECT count(*), coalesce(avg(pg_column_size(t.*)), 0) FROM {table} t"
            ).fetchone()  # type: ignore[misc]
            out[table] = (int(n), float(size))
    return out


def storage_bytes(windows: Sequence[Mapping[str, Any]], window_steps: int) -> dict[str, Any]:
    """Rows and bytes per row stored from the bodies with and without ``comm``."""
    from benchmarks._harness import pg_database

    plain = [{k: v for k, v in p.items() if k != "comm"} for p in windows]
    with pg_database("stepwatch_bench_comm") as url:
        timed = _stored(url, windows, window_steps)
    with pg_database("stepwatch_bench_nocomm") as url:
        untimed = _stored(url, plain, window_steps)
    return {"with": timed, "without": untimed, "window_steps": window_steps}


def run(steps: int = 48, send_interval: float = 4.0) -> dict[str, Any]:
    windows = record(steps, send_interval)
    return {"payload": payload_bytes(windows), "storage": storage_bytes(windows, 16)}


def report(f: Mapping[str, Any]) -> list[str]:
    p, s = f["payload"], f["storage"]
    lines = [
        f"comm payload: {p['windows']:.0f} real window bodies of 4 gloo ranks (10 DDP buckets), "
        f"{p['steps']:.1f} steps each on average",
        f"  body with comm {p['with']:.0f} B, without {p['without']:.0f} B: the comm section adds "
        f"{p['growth']:.0f} B per window = {p['fixed']:.0f} B per window + {p['per_step']:.1f} B per step",
    ]
    for n in WINDOW_SIZES:
        grow = p["fixed"] + p["per_step"] * n
        lines.append(
            f"  a rank-window of {n} steps: +{grow:,.0f} B "
            f"({'within' if grow <= PAYLOAD_BUDGET else 'OVER'} the {PAYLOAD_BUDGET} B budget)"
        )
    w, wo = s["with"], s["without"]
    rw = w["rank_windows"][1] - wo["rank_windows"][1]
    lines.append(
        f"  stored (PostgreSQL, {s['window_steps']} steps per rank-window): rank_windows row "
        f"{w['rank_windows'][1]:.0f} B with comm, {wo['rank_windows'][1]:.0f} B without: {rw:+.0f} B per row "
        f"({'within' if rw <= ROW_BUDGET else 'OVER'} the {ROW_BUDGET} B budget)"
    )
    per_window = w["step_timings"][0] / max(w["rank_windows"][0], 1)
    lines.append(
        f"  staged until analysed (deleted then): step_timings {w['step_timings'][0]} rows "
        f"(one per rank and batch, its steps packed) of {w['step_timings'][1]:.0f} B "
        f"({per_window:.1f} per rank-window: "
        f"{per_window * w['step_timings'][1]:,.0f} B); link_samples {w['link_samples'][0]} rows of "
        f"{w['link_samples'][1]:.0f} B"
    )
    lines.append(
        f"  kept per rank, not per window: rank_groups {w['rank_groups'][0]} rows "
        f"of {w['rank_groups'][1]:.0f} B"
    )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--send-interval", type=float, default=4.0, help="the agent's window, seconds")
    args = p.parse_args(argv)
    for line in report(run(args.steps, args.send_interval)):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
