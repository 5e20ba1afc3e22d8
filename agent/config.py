"""Agent settings: explicit arguments first, then ``STEPWATCH_*`` environment variables.

A plain dataclass on purpose: the agent lives in the training process and imports
nothing heavier than it needs (no pydantic).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from . import _env, wire

DEFAULT_URL = "http://127.0.0.1:8321"
DEFAULT_PROFILE_EVERY = 2000
RUN_NAME = re.compile(wire.RUN_NAME_PATTERN)


@dataclass(frozen=True)
class AgentConfig:
    run: str
    url: str = DEFAULT_URL
    token: str | None = None
    enabled: bool = True
    #: A window closes (and is queued for sending) after this many seconds of steps...
    send_interval_s: float = 10.0
    #: ...or after this many steps, whichever comes first. Bounds the per-window arrays.
    max_window_steps: int = 1024
    #: The first steps after (re)start are tagged warm-up and kept out of baselines.
    warmup_steps: int = 10
    #: Memory bound of the outbound queue while the collector is away.
    max_buffer_bytes: int = 32 * 1024 * 1024
    #: How long ``close()`` (and the exit hook) may take to send what is queued.
    flush_timeout_s: float = 5.0
    http_timeout_s: float = 5.0
    #: A batch the collector fails on (500 and other 5xx but 502/503/504) is dropped and
    #: counted after this many attempts, so it cannot hold up the windows behind it.
    max_attempts: int = 5
    #: A profiler window of ``profile_steps`` steps starts every ``profile_every`` steps
    #: (0 turns it off); the period is stretched (x2, x4, ...) while the window's
    #: self-measured cost exceeds ``profile_budget`` of training time. Rare by default:
    #: the always-on timing finds a slow rank, and a capture (asked for by its flag or a
    #: person, ``_steering``) profiles it and its peers when it matters.
    profile_every: int = DEFAULT_PROFILE_EVERY
    profile_steps: int = 2
    profile_budget: float = 0.01
    #: Per-host batching (``_relay``, Linux): the ranks of a host post their windows
    #: together, one request per host and window instead of one per rank. :func:`load`
    #: turns it on where the launcher says the host runs several ranks
    #: (:func:`host_batch_default`); a config built by hand has it off.
    host_batch: bool = False


def _host_batch(explicit: bool | None, env: Mapping[str, str]) -> bool:
    if explicit is not None:
        return explicit
    flag = _flag(env, "STEPWATCH_HOST_BATCH")
    return host_batch_default(env) if flag is None else flag


def _env_float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw in (None, ""):
        return default
    try:
        return float(raw)
    except ValueError as exc:
        raise ValueError(f"{name}={raw!r} is not a number") from exc


def _truthy(raw: str | None) -> bool:
    return raw is not None and raw.strip().lower() in ("1", "true", "yes", "on")


def _flag(env: Mapping[str, str], name: str) -> bool | None:
    """A boolean setting; None where it is unset, empty or ``auto`` (the default applies)."""
    raw = (env.get(name) or "").strip().lower()
    if raw in ("", "auto"):
        return None
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be 1/0 (true/false, yes/no, on/off) or auto, got {env[name]!r}")


def host_batch_default(env: Mapping[str, str]) -> bool:
    """Per-host batching is on by default for a rank that shares its host with others of
    its job, as the launcher says (:func:`stepwatch._env.local_world_size`: torchrun's
    ``LOCAL_WORLD_SIZE``, Slurm's ``srun``, Open MPI). One POST per host and window
    instead of one per rank is 8x fewer requests and connections at 8 GPUs a host, and
    the collector takes 2.2-2.5x the rank-steps per second that way (``python -m
    benchmarks.ingest``: per host against per rank). A lone process has no one to batch
    with."""
    return _env.local_world_size(env) > 1


def load(
    run: str | None = None,
    *,
    url: str | None = None,
    token: str | None = None,
    send_interval_s: float | None = None,
    warmup_steps: int | None = None,
    flush_timeout_s: float | None = None,
    profile_every: int | None = None,
    profile_steps: int | None = None,
    profile_budget: float | None = None,
    host_batch: bool | None = None,
    env: Mapping[str, str] | None = None,
) -> AgentConfig:
    """Resolve the configuration; a bad value raises ValueError naming the setting."""
    env = os.environ if env is None else env
    name = run or env.get("STEPWATCH_RUN") or "default"
    if not RUN_NAME.match(name):
        raise ValueError(
            f"run name {name!r} must be 1-128 characters of letters, digits and ._:- "
            "(starting with a letter or digit)"
        )
    interval = (
        send_interval_s if send_interval_s is not None else _env_float(env, "STEPWATCH_SEND_INTERVAL_S", 10.0)
    )
    if not interval > 0:
        raise ValueError(f"send_interval_s must be > 0, got {interval}")
    warmup = warmup_steps if warmup_steps is not None else int(_env_float(env, "STEPWATCH_WARMUP_STEPS", 10))
    if warmup < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup}")
    every = (
        profile_every
        if profile_every is not None
        else int(_env_float(env, "STEPWATCH_PROFILE_EVERY", DEFAULT_PROFILE_EVERY))
    )
    k = profile_steps if profile_steps is not None else int(_env_float(env, "STEPWATCH_PROFILE_STEPS", 2))
    budget = (
        profile_budget if profile_budget is not None else _env_float(env, "STEPWATCH_PROFILE_BUDGET", 0.01)
    )
    if every < 0 or (every and not 1 <= k < every) or k > 16:
        raise ValueError(
            f"profile_every must be 0 (off) or larger than profile_steps (1-16), got {every} and {k}"
        )
    attempts = int(_env_float(env, "STEPWATCH_MAX_ATTEMPTS", 5))
    if attempts < 1:
        raise ValueError(f"STEPWATCH_MAX_ATTEMPTS must be >= 1, got {attempts}")
    if not 0 < budget <= 1:
        raise ValueError(f"profile_budget must be in (0, 1], got {budget}")
    return AgentConfig(
        run=name,
        url=url or env.get("STEPWATCH_URL") or DEFAULT_URL,
        token=token or env.get("STEPWATCH_TOKEN") or None,
        enabled=not _truthy(env.get("STEPWATCH_DISABLED")),
        send_interval_s=interval,
        warmup_steps=warmup,
        flush_timeout_s=(
            flush_timeout_s
            if flush_timeout_s is not None
            else _env_float(env, "STEPWATCH_FLUSH_TIMEOUT_S", 5.0)
        ),
        profile_every=every,
        profile_steps=k,
        profile_budget=budget,
        max_attempts=attempts,
        host_batch=_host_batch(host_batch, env),
    )
