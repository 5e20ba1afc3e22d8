"""The wire format: one versioned JSON document per window of one rank.

Columns, not rows: a window of N steps is a handful of arrays of length N, which is
both the cheapest thing to build and the cheapest thing for the collector to validate.
Everything that identifies the sender (run, rank, host, layout) and what makes MFU
comparable (the FLOPs convention) travels with every batch, so the collector needs no
session state and any replica can accept any batch.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from ._window import Window
from .wire import SCHEMA_VERSION, TAGS


def new_batch_id() -> str:
    """A random 128-bit id: retries of the same batch carry it, so it is stored once."""
    return uuid.uuid4().hex


def _floats(values: Sequence[float]) -> list[float]:
    # JSON has no NaN/inf; a clock that misbehaves must not make the whole batch invalid.
    return [v if math.isfinite(v) and v >= 0.0 else 0.0 for v in values]


def _counts(values: Sequence[int]) -> list[int]:
    return [v if v > 0 else 0 for v in values]


def build_payload(
    window: Window,
    *,
    run: str,
    rank: Mapping[str, Any],
    convention: Mapping[str, Any] | None,
    agent: Mapping[str, Any],
    step_time_s: Sequence[float] | None = None,
    sent_at: float,
    plan: Mapping[str, Any] | None = None,
    profiles: Sequence[Mapping[str, Any]] | None = None,
    comm: Mapping[str, Any] | None = None,
    acks: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """Assemble the payload dict for one window (sender thread only).

    Optional sections are left out when empty, so a collector that predates them still
    accepts the batch: ``plan`` (run-level: target tokens, deadline, config fingerprint,
    baseline run), ``profiles`` (the profiler windows finished since the last batch, see
    :mod:`.profiler._entry`), ``final`` (the rank's last batch), ``heartbeat`` (a batch
    without steps sent while the training thread closes no window) and ``comm`` (the always-on
    collective timing of these steps, a section with its own ``version``; see
    ``_comm_timing.summarise``) and ``acks`` (the acknowledgements of the collector's
    directives, ``wire``'s steering contract).
    """
    times = step_time_s if step_time_s is not None else window.step_time_s
    tags = window.tags
    steps: dict[str, Any] = {
        "first": window.first_step,
        "time_s": _floats(times),
        "data_wait_s": _floats(window.data_wait_s),
        "tokens": _counts(window.tokens),
        "padded_tokens": _counts(window.padded_tokens) if window.padded_tokens is not None else None,
        "tags": [TAGS[t] or None for t in tags] if tags is not None and any(tags) else None,
        "wall_end": window.wall_end,
    }
    if window.profiles_through is not None:
        steps["profiles_through"] = window.profiles_through
    payload: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "batch_id": window.batch_id,
        "run": run,
        "sent_at": sent_at,
        "agent": dict(agent),
        "rank": dict(rank),
        "convention": dict(convention) if convention is not None else None,
        "steps": steps,
    }
    if plan:
        payload["plan"] = dict(plan)
    if profiles:
        payload["profiles"] = [dict(p) for p in profiles]
    if comm:
        payload["comm"] = dict(comm)
    if acks:
        payload["acks"] = [dict(a) for a in acks]
    if window.final:
        payload["final"] = True
    if window.heartbeat:
        payload["heartbeat"] = True
    return payload


def plan_section(
    *,
    target_tokens: int | None = None,
    deadline: float | None = None,
    config_fingerprint: str | None = None,
    baseline_run: str | None = None,
) -> dict[str, Any] | None:
    """The run-level ``plan`` section, or ``None`` when nothing was given."""
    plan = {
        "target_tokens": target_tokens,
        "deadline": deadline,
        "config_fingerprint": config_fingerprint,
        "baseline_run": baseline_run,
    }
    return {k: v for k, v in plan.items() if v is not None} or None


def encode(payload: Mapping[str, Any]) -> bytes:
    return json.dumps(payload, separators=(",", ":"), allow_nan=False).encode()
