"""``stepwatch capture`` and ``stepwatch config``: steering a running job from a terminal.

Both only talk to the collector (an admin token when it has tokens); the ranks get the
request in the answers to their next batches. ``capture`` then waits for the explanation
and prints it: the subject rank against its peers, and each captured rank's breakdown.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from .client import CollectorClient, CollectorError

POLL_S = 1.0


def _say(text: str) -> None:
    print(text, flush=True)


def _ms(x: Any) -> str:
    return "-" if x is None else f"{float(x) * 1e3:.1f}"


def _print_result(c: dict[str, Any]) -> None:
    r = c.get("result") or {}
    _say(f"capture {c['id']}: {r.get('message', '')}")
    for rank, d in sorted((r.get("per_rank") or {}).items(), key=lambda kv: int(kv[0])):
        if d.get("skipped"):
            _say(f"  rank {rank}: missed ({d['skipped']})")
            continue
        b = d.get("breakdown") or {}
        top = (d.get("top_ops") or [])[:3]
        ops = ", ".join(f"{o['name']} {_ms(o['self_s'])} ms" for o in top)
        _say(
            f"  rank {rank}: step {_ms(b.get('step_s'))} ms = compute {_ms(b.get('compute_s'))}, "
            f"exposed comm {_ms(b.get('comm_exposed_s'))}, data {_ms(b.get('data_wait_s'))}, "
            f"idle {_ms(b.get('idle_s'))}; {ops}"
        )


def capture(
    url: str,
    run: str,
    *,
    token: str | None,
    rank: int | None,
    host: str | None,
    everyone: bool,
    steps: int | None,
    wait_s: float,
) -> int:
    try:
        with CollectorClient(url, token=token) as client:
            c = client.capture(run, rank=rank, host=host, all=everyone, steps=steps)
            ranks = c["ranks"]
            _say(
                f"capture {c['id']} of run {run}: steps {c['first_step']}-{c['first_step'] + c['steps'] - 1} "
                f"on {len(ranks)} rank(s) {ranks[:16]}{' ...' if len(ranks) > 16 else ''}"
            )
            for note in c.get("notes") or []:
                _say(f"  note: {note}")
            deadline = time.monotonic() + max(0.0, wait_s)
            while c["status"] != "done" and time.monotonic() < deadline:
                time.sleep(POLL_S)
                c = client.get_capture(run, c["id"])
            if c["status"] != "done":
                if wait_s > 0:
                    _say(f"not explained yet; see {url.rstrip('/')}/api/v1/runs/{run}/captures/{c['id']}")
                return 0 if wait_s <= 0 else 1
            _print_result(c)
            return 0
    except CollectorError as exc:
        print(f"stepwatch capture: {exc}", file=sys.stderr)
        return 1


def configure(
    url: str, run: str, settings: dict[str, float], *, token: str | None, ranks: list[int] | None
) -> int:
    if not settings:
        print("stepwatch config: give --send-interval, --profile-every or --profile-steps", file=sys.stderr)
        return 2
    try:
        with CollectorClient(url, token=token) as client:
            state = client.put_config(run, settings, ranks)
    except CollectorError as exc:
        print(f"stepwatch config: {exc}", file=sys.stderr)
        return 1
    who = "every rank" if state.get("ranks") is None else f"ranks {state['ranks']}"
    _say(
        f"config {state['id']} of run {run}: {state['settings']} for {who}; "
        "each rank applies it at its next window"
    )
    return 0
