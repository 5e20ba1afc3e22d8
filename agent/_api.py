"""``stepwatch.init``: the one call that sets the agent up."""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from . import _dtype, _env, config, wire
from ._agent import Stepwatch
from ._clock_sync import ClockSync
from ._device_clock import cuda_clock
from ._nvml import for_current_cuda_device
from ._payload import plan_section
from .profiler._window import ProfilerWindow

_FINGERPRINT = re.compile(wire.FINGERPRINT_PATTERN)

log = logging.getLogger("stepwatch")
_current: Stepwatch | None = None


def current() -> Stepwatch | None:
    """The agent made by the last ``init`` in this process, if any."""
    return _current


def _model_on_cuda(model: Any) -> bool:
    try:
        param = next(iter(model.parameters()))
    except (AttributeError, StopIteration, TypeError):
        return False
    return bool(getattr(param, "is_cuda", False))


def init(
    run: str | None = None,
    *,
    model: Any = None,
    seq_len: int | None = None,
    url: str | None = None,
    token: str | None = None,
    flops_per_token: float | None = None,
    formula: str = "auto",
    attention: str = "causal",
    n_layers: int | None = None,
    d_model: int | None = None,
    active_params: int | None = None,
    exclude_embeddings: bool = True,
    dtype: str | None = None,
    device_name: str | None = None,
    peak_flops: float | None = None,
    recompute: str | None = None,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    rank: int | None = None,
    local_rank: int | None = None,
    world_size: int | None = None,
    host: str | None = None,
    start_step: int = 0,
    send_interval_s: float | None = None,
    warmup_steps: int | None = None,
    flush_timeout_s: float | None = None,
    target_tokens: int | None = None,
    deadline: float | datetime | None = None,
    config_fingerprint: str | None = None,
    baseline_run: str | None = None,
    profile_every: int | None = None,
    profile_steps: int | None = None,
    profile_budget: float | None = None,
    host_batch: bool | None = None,
    sample_batch: object = None,
    loss_fn: Callable[[Any], Any] | None = None,
    collectives: bool = False,
) -> Stepwatch:
    """Set up the agent for this process and return its handle.

    Configuration mistakes (a layout that does not divide the world, a bad run name)
    raise ``ValueError`` here, at start-up, where they are cheap to fix. Anything that
    fails later stays inside the agent. Calling ``init`` again closes the previous
    agent (flushing it) and starts a new one.

    The plan, all optional: ``target_tokens`` (real tokens the run must process) and
    ``deadline`` (a timezone-aware ``datetime`` or Unix seconds) give the projected
    finish and the step time needed to meet it; ``config_fingerprint`` (any short id of
    the configuration that makes two runs comparable) and ``baseline_run`` (the name of
    an earlier run with the same fingerprint) make regressions compare against that run.

    ``formula="measured"`` with ``sample_batch=`` (and optionally ``loss_fn=``) counts the
    model's FLOPs per token once, here, with ``torch.utils.flop_counter`` (one forward and
    backward of the real model). ``profile_every``/``profile_steps``/``profile_budget``
    set the profiler window (see ``stepwatch.profiler._window``; ``profile_every=0`` turns it off).
    ``host_batch`` (``STEPWATCH_HOST_BATCH``) posts the windows of a host's ranks together,
    one request per host and window (``stepwatch._relay``); on by default where the host
    runs several ranks of the job (``LOCAL_WORLD_SIZE`` > 1, as torchrun sets it, or
    Slurm's ``srun`` or Open MPI says so), ``False`` (``0``) posts each rank's alone.
    A ``DistributedDataParallel`` ``model`` gets the always-on collective timing (``Stepwatch.watch``).
    ``collectives=True`` also counts plain ``torch.distributed`` collectives (tensor and
    pipeline parallel, FSDP2) for the hang diagnosis (``Stepwatch.watch_collectives``).
    """
    global _current
    plan = _plan(target_tokens, deadline, config_fingerprint, baseline_run)
    cfg = config.load(
        run,
        url=url,
        token=token,
        send_interval_s=send_interval_s,
        warmup_steps=warmup_steps,
        flush_timeout_s=flush_timeout_s,
        profile_every=profile_every,
        profile_steps=profile_steps,
        profile_budget=profile_budget,
        host_batch=host_batch,
    )
    info = _env.detect(
        rank=rank, local_rank=local_rank, world_size=world_size, host=host, tp=tp, pp=pp, cp=cp, ep=ep
    )
    if start_step < 0:
        raise ValueError(f"start_step must be >= 0, got {start_step}")
    with _init_warnings(cfg.enabled):
        used_dtype, dtype_source = _dtype.resolve(dtype, model, warn=info.rank == 0)
        convention = _convention(
            model=model,
            seq_len=seq_len,
            flops_per_token=flops_per_token,
            formula=formula,
            attention=attention,
            n_layers=n_layers,
            d_model=d_model,
            exclude_embeddings=exclude_embeddings,
            active_params=active_params,
            dtype=used_dtype,
            device_name=device_name,
            peak_flops=peak_flops,
            recompute=recompute,
            sample_batch=sample_batch,
            loss_fn=loss_fn,
        )
    if convention is not None:
        convention["dtype_source"] = dtype_source
        if convention.get("peak_flops") is None and info.rank == 0 and cfg.enabled:
            _warn_no_peak(convention)
    on_cuda = model is not None and _model_on_cuda(model)
    clock = cuda_clock(cfg.max_window_steps) if on_cuda else None
    profiler = _profiler(cfg, info, start_step=start_step, cuda=on_cuda) if cfg.enabled else None
    if _current is not None:
        _current.close()
    _current = Stepwatch(
        cfg,
        info,
        convention=convention,
        start_step=start_step,
        device_clock=clock,
        plan=plan,
        profiler=profiler,
    )
    if convention is not None and dtype_source in (_dtype.PARAMETERS, _dtype.DEFAULT):
        _dtype.watch_first_forward(model, _autocast_seen(_current))
    if _is_ddp(model):  # always-on collective timing, with DDP's own all-reduce
        _current.watch(model)
    if collectives and cfg.enabled:
        _current.watch_collectives()
    return _current


def _autocast_seen(sw: Stepwatch) -> Callable[[str], None]:
    """The first forward ran under autocast: restate the convention at its dtype (before
    the first window is encoded, which happens a send interval later at the earliest)."""

    def update(dtype: str) -> None:
        conv = sw.convention
        if conv is not None and conv.get("dtype") != dtype:
            sw.convention = _dtype.with_dtype(dict(conv), dtype, _dtype.AUTOCAST)

    return update


@contextmanager
def _init_warnings(enabled: bool) -> Iterator[None]:
    """``STEPWATCH_DISABLED=1`` prints nothing at all; and the table's own unknown-peak
    warning (one per rank) gives way to ``_warn_no_peak`` (rank 0's, one per job)."""
    from .flops import UnknownPeakWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnknownPeakWarning)
        if not enabled:
            warnings.simplefilter("ignore")
        yield


def _convention(**kwargs: Any) -> dict[str, Any] | None:
    """The run's FLOPs convention as sent, or None (MFU null) with one warning: MFU is
    optional, the rest of the agent works without it. Configuration mistakes raise."""
    try:
        from .flops import resolve_convention

        return resolve_convention(**kwargs).to_dict()
    except ValueError:
        raise
    except Exception as exc:
        warnings.warn(
            f"stepwatch: no FLOPs convention, MFU will be null ({exc!r})", RuntimeWarning, stacklevel=3
        )
        return None


_no_peak_warned: set[tuple[str, str]] = set()


def _warn_no_peak(convention: dict[str, Any]) -> None:
    """Rank 0 only, once per process per (device, dtype): one line per job saying how to
    get MFU, not the same line from every rank."""
    from .flops import UnknownPeakWarning

    key = (str(convention.get("device_name")), str(convention.get("dtype")))
    if key in _no_peak_warned:
        return
    _no_peak_warned.add(key)
    device, dtype = key
    warnings.warn(
        f"stepwatch: no dense peak FLOP/s known for device {device!r} at {dtype}, so MFU is null "
        "(step time, tokens/s and the breakdown still work). Give it with "
        f"stepwatch.init(..., peak_flops=<dense FLOP/s of ONE device at {dtype}>): the vendor's "
        "dense (not sparse) datasheet figure, or measure one as the best rate of a large matmul "
        "at that dtype, 2*n**3 FLOPs / seconds (stepwatch.demo.runner.measure_cpu_peak_flops() "
        "does this for one CPU thread). Printed by rank 0 only.",
        UnknownPeakWarning,
        stacklevel=3,
    )


def _is_ddp(model: Any) -> bool:
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:
        return False
    return isinstance(model, DistributedDataParallel)


def _plan(
    target_tokens: int | None,
    deadline: float | datetime | None,
    config_fingerprint: str | None,
    baseline_run: str | None,
) -> dict[str, Any] | None:
    """Validate the plan arguments at init, where a mistake is cheap to fix."""
    if target_tokens is not None and (isinstance(target_tokens, bool) or int(target_tokens) <= 0):
        raise ValueError(f"target_tokens must be a positive int, got {target_tokens!r}")
    when: float | None = None
    if isinstance(deadline, datetime):
        if deadline.tzinfo is None:
            raise ValueError("deadline must be a timezone-aware datetime (or Unix seconds)")
        when = deadline.timestamp()
    elif deadline is not None:
        when = float(deadline)
        if not when > 0:
            raise ValueError(f"deadline must be Unix seconds > 0, got {deadline!r}")
    if config_fingerprint is not None and not _FINGERPRINT.match(config_fingerprint):
        raise ValueError("config_fingerprint must be 1-128 characters of letters, digits and ._:/+=-")
    if baseline_run is not None and not config.RUN_NAME.match(baseline_run):
        raise ValueError(f"baseline_run {baseline_run!r} is not a valid run name")
    return plan_section(
        target_tokens=None if target_tokens is None else int(target_tokens),
        deadline=when,
        config_fingerprint=config_fingerprint,
        baseline_run=baseline_run,
    )


def _profiler(
    cfg: config.AgentConfig, info: _env.RankInfo, *, start_step: int, cuda: bool
) -> ProfilerWindow | None:
    """The profiler window (periodic off with ``profile_every=0``: it then still runs the
    collector's captures), or None when torch is missing (then no breakdown)."""
    try:
        import torch.profiler  # noqa: F401
    except ImportError:
        warnings.warn("stepwatch: torch is not importable, no profiler window", RuntimeWarning, stacklevel=3)
        return None
    single_host = _env.local_world_size() == info.world_size or info.world_size == 1
    pw = ProfilerWindow(
        every=cfg.profile_every,
        steps=cfg.profile_steps,
        budget=cfg.profile_budget,
        warmup_end=start_step + cfg.warmup_steps,
        cuda=cuda,
        clock_sync=ClockSync(info.rank, info.host, single_host=single_host),
        nvml=for_current_cuda_device() if cuda else None,
    )
    if cfg.profile_every > 0:  # with the periodic window off, a first capture pays the imports
        pw.warm()
    return pw
