"""The precision MFU is measured against, when ``init`` is not told (``dtype=None``).

MFU divides by the dense peak of one device *at the dtype the matmuls run in*: an fp32
run measured against the bf16 peak reads 2-16x too low, a bf16 run against the fp32 peak
as much too high. So the dtype is never silently assumed; it is, first match wins:

1. ``given``: the ``dtype=`` argument (the Lightning and Hugging Face callbacks pass the
   trainer's precision);
2. ``autocast``: autocast enabled for the model's device type, at ``init`` or, since
   autocast usually wraps only the forward pass, at the model's first forward (a
   one-shot forward pre-hook: fp32 master weights under ``torch.autocast(dtype=bf16)``
   are a bf16 run);
3. ``parameters``: the dtype holding most of the model's floating-point parameters;
   fp32 parameters on CUDA count as ``tf32`` when TF32 matmuls are allowed
   (``torch.backends.cuda.matmul.allow_tf32`` or ``torch.get_float32_matmul_precision()``
   ``"high"``/``"medium"``);
4. ``default``: nothing to infer from (no model): ``bf16``, the common large-model
   precision, said so in the convention and in one warning (rank 0's).

The answer and how it was found (``dtype_source``) travel in the run's FLOPs convention,
so every view that shows MFU can show them with it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from .flops.peaks import normalize_dtype

GIVEN, AUTOCAST, PARAMETERS, DEFAULT = "given", "autocast", "parameters", "default"
DEFAULT_DTYPE = "bf16"


def resolve(dtype: str | None, model: Any, *, warn: bool = True) -> tuple[str, str]:
    """``(dtype, how)``: the dtype to look the peak up at and which rule gave it. ``warn``:
    say so when it had to be assumed (rank 0 does, for the job)."""
    if dtype is not None:
        return normalize_dtype(dtype), GIVEN
    autocast = autocast_dtype(model)
    if autocast is not None:
        return autocast, AUTOCAST
    from_params = parameter_dtype(model)
    if from_params is not None:
        return from_params, PARAMETERS
    if not warn:
        return DEFAULT_DTYPE, DEFAULT
    warnings.warn(
        f"stepwatch: dtype not given and no model= to infer it from; MFU is measured against "
        f"the {DEFAULT_DTYPE} peak. Pass dtype= ('fp32', 'tf32', 'bf16', 'fp16', 'fp8') if the "
        "run's matmuls run in another precision.",
        RuntimeWarning,
        stacklevel=3,
    )
    return DEFAULT_DTYPE, DEFAULT


def _device_type(model: Any) -> str | None:
    try:
        param = next(iter(model.parameters()))
    except (AttributeError, StopIteration, TypeError):
        return None
    device = getattr(param, "device", None)
    return str(getattr(device, "type", "")) or None


def autocast_dtype(model: Any) -> str | None:
    """The autocast dtype, when autocast is on for the model's device type right now."""
    device_type = _device_type(model)
    if device_type is None:
        return None
    try:
        import torch

        if not torch.is_autocast_enabled(device_type):
            return None
        return normalize_dtype(torch.get_autocast_dtype(device_type))
    except Exception:  # an old torch, an exotic device: nothing inferred
        return None


def parameter_dtype(model: Any) -> str | None:
    """The dtype of most floating-point parameter elements (tf32 for fp32 on CUDA with
    TF32 matmuls allowed), or None when the model has none."""
    try:
        import torch

        counts: dict[Any, int] = {}
        cuda = False
        for p in model.parameters():
            if isinstance(p, torch.Tensor) and p.is_floating_point():
                counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
                cuda = cuda or p.is_cuda
        if not counts:
            return None
        top = max(counts, key=lambda d: counts[d])
        name = normalize_dtype(top)
        if name == "fp32" and cuda and _tf32_matmuls(torch):
            return "tf32"
        return name
    except Exception:  # not a torch model: nothing inferred
        return None


def _tf32_matmuls(torch: Any) -> bool:
    return bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() in (
        "high",
        "medium",
    )


def watch_first_forward(model: Any, on_autocast: Callable[[str], None]) -> None:
    """Call ``on_autocast(dtype)`` if the model's first forward runs under autocast.

    One forward pre-hook, removed at its first call: it reads two thread-local flags, so
    it costs one forward nothing measurable and later forwards nothing at all. Any
    failure leaves the dtype as inferred at init."""
    register = getattr(model, "register_forward_pre_hook", None)
    if not callable(register):
        return
    handle: Any = None

    def hook(module: Any, args: Any) -> None:
        try:
            handle.remove()
            found = autocast_dtype(module)
            if found is not None:
                on_autocast(found)
        except Exception:
            pass

    try:
        handle = register(hook)
    except Exception:
        return


def with_dtype(convention: dict[str, Any], dtype: str, how: str) -> dict[str, Any]:
    """The convention (``Convention.to_dict()`` form) re-stated at another dtype: the peak
    is looked up again unless the user gave it, the id follows."""
    import dataclasses

    from .flops import Convention, lookup_peak

    conv = Convention.from_dict(convention)
    peak, source = conv.peak_flops, conv.peak_source
    if source != "user":
        found = lookup_peak(conv.device_name or "cpu", dtype)
        peak, source = found if found is not None else (None, None)
    out = dataclasses.replace(conv, dtype=dtype, peak_flops=peak, peak_source=source).to_dict()
    out["dtype_source"] = how
    return out
