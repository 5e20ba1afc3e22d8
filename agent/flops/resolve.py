"""``resolve_convention``: the run's MFU convention from what ``stepwatch.init`` was given
and what the model says of itself (its shape, its device)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from . import formulas
from ._checks import choice, opt_positive_float, opt_positive_int, positive_float, positive_int
from .convention import ATTENTIONS, FORMULAS, RECOMPUTES, Convention
from .formulas import count_params, hfu_flops_per_token
from .measure import FlopsUnavailableError, measure_flops_per_token
from .peaks import lookup_peak, normalize_dtype, warn_unknown_peak

__all__ = ["resolve_convention"]


def _int_attr(obj: object, names: Sequence[str]) -> int | None:
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _discover_shape(model: object) -> tuple[int | None, int | None]:
    """(n_layers, d_model) from the model, when it says so plainly.

    Looked for, in order, on the model, on ``model.module`` (DDP) and ``model._orig_mod``
    (``torch.compile``): a Hugging Face style ``config`` (``num_hidden_layers``/``n_layer``/
    ``n_layers``/``num_layers``; attention width ``num_attention_heads x head_dim`` when both
    are given, else ``hidden_size``/``n_embd``/``d_model``/``dim``), then plain ``n_layers``
    and ``d_model`` attributes on the module. No guessing from the module tree: a wrong L
    or d would give a wrong MFU with a trustworthy-looking id.
    """
    candidates = [model, getattr(model, "module", None), getattr(model, "_orig_mod", None)]
    for obj in candidates:
        if obj is None:
            continue
        config = getattr(obj, "config", None)
        if config is not None:
            layers = _int_attr(config, ("num_hidden_layers", "n_layer", "n_layers", "num_layers"))
            heads = _int_attr(config, ("num_attention_heads", "n_head", "n_heads"))
            head_dim = _int_attr(config, ("head_dim",))
            width = heads * head_dim if heads is not None and head_dim is not None else None
            if width is None:
                width = _int_attr(config, ("hidden_size", "n_embd", "d_model", "dim"))
            if layers is not None and width is not None:
                return layers, width
        layers = _int_attr(obj, ("n_layers",))
        width = _int_attr(obj, ("d_model",))
        if layers is not None and width is not None:
            return layers, width
    return None, None


def _detect_device_name(model: object) -> str:
    """``torch.cuda.get_device_name`` of the model's device (else the current one), or ``"cpu"``."""
    try:
        import torch
    except ImportError:
        return "cpu"
    try:
        if not torch.cuda.is_available():
            return "cpu"
        parameters = getattr(model, "parameters", None)
        if callable(parameters):
            for param in parameters():
                if isinstance(param, torch.Tensor):
                    if param.is_cuda:
                        return str(torch.cuda.get_device_name(param.device))
                    if param.device.type != "meta":
                        return "cpu"
                break
        return str(torch.cuda.get_device_name(torch.cuda.current_device()))
    except (RuntimeError, AssertionError):  # a broken CUDA setup must not stop init
        return "cpu"


def resolve_convention(
    *,
    model: Any = None,
    seq_len: int | None = None,
    flops_per_token: float | None = None,
    formula: str = "auto",
    attention: str = "causal",
    n_layers: int | None = None,
    d_model: int | None = None,
    exclude_embeddings: bool = True,
    active_params: int | None = None,
    dtype: str = "bf16",
    device_name: str | None = None,
    peak_flops: float | None = None,
    recompute: str | None = None,
    n_params: int | None = None,
    sample_batch: object = None,
    loss_fn: Callable[[Any], Any] | None = None,
) -> Convention:
    """Fix the MFU convention of a run, once, at init.

    FLOPs per token, first match wins:

    * ``flops_per_token`` given -> formula ``"explicit"`` (or ``"measured"`` when
      ``formula="measured"``: a value measured elsewhere, recorded as such);
    * ``formula="measured"`` -> :func:`measure_flops_per_token` on ``model`` and
      ``sample_batch``;
    * otherwise N = ``active_params``, else ``n_params``, else :func:`count_params` of
      ``model`` (``exclude_embeddings`` states which N it is, counted or given), and
      ``formula="auto"`` picks ``"6N+12LHQT"`` when ``n_layers``, ``d_model`` and
      ``seq_len`` are known (given, or ``n_layers``/``d_model`` discovered from the model,
      see :func:`_discover_shape`; ``seq_len`` is the training length and must be given),
      else ``"6N"``.

    Peak: ``peak_flops`` wins (source ``"user"``), else the table (:func:`lookup_peak`) for
    ``device_name`` (default: the model's CUDA device name, else ``"cpu"``), else ``None``
    with one :class:`UnknownPeakWarning` per process per (device, dtype).

    Raises ``ValueError`` for invalid or contradictory arguments and
    :class:`FlopsUnavailableError` when there is nothing to count FLOPs from.
    """
    choice("formula", formula, ("auto", *FORMULAS))
    choice("attention", attention, ATTENTIONS)
    choice("recompute", recompute, (None, *RECOMPUTES))
    seq = opt_positive_int("seq_len", seq_len)
    layers = opt_positive_int("n_layers", n_layers)
    width = opt_positive_int("d_model", d_model)
    peak_arg = opt_positive_float("peak_flops", peak_flops)
    if model is not None and (layers is None or width is None):
        found_layers, found_width = _discover_shape(model)
        layers = layers if layers is not None else found_layers
        width = width if width is not None else found_width
    shape_known = layers is not None and width is not None and seq is not None

    n_used: int | None = None
    embeddings_counted = False
    if flops_per_token is not None:
        if formula not in ("auto", "explicit", "measured"):
            raise ValueError(f"flops_per_token= contradicts formula={formula!r}; use 'explicit'")
        used_formula = "measured" if formula == "measured" else "explicit"
        model_flops = positive_float("flops_per_token", flops_per_token)
    elif formula == "explicit":
        raise ValueError("formula='explicit' needs flops_per_token=")
    elif formula == "measured":
        if model is None or sample_batch is None:
            raise ValueError("formula='measured' needs model= and sample_batch= (or flops_per_token=)")
        used_formula = "measured"
        model_flops = measure_flops_per_token(model, sample_batch, loss_fn=loss_fn)
    else:
        if active_params is not None:
            n_used = positive_int("active_params", active_params)
        elif n_params is not None:
            n_used = positive_int("n_params", n_params)
        elif model is not None:
            n_used = count_params(model, exclude_embeddings=exclude_embeddings)
        else:
            raise FlopsUnavailableError(
                "no model=, n_params= or flops_per_token= given: FLOPs per token unknown, MFU will be null"
            )
        if n_used <= 0:
            raise FlopsUnavailableError("the model has no (non-embedding) parameters to count")
        embeddings_counted = not exclude_embeddings
        used_formula = formula
        if formula == "auto":
            used_formula = "6N+12LHQT" if shape_known else "6N"
        if used_formula == "6N+12LHQT" and not shape_known:
            missing = [
                name for name, v in (("n_layers", layers), ("d_model", width), ("seq_len", seq)) if v is None
            ]
            raise ValueError(f"formula '6N+12LHQT' needs {', '.join(missing)}")
        model_flops = formulas.flops_per_token(
            n_used, formula=used_formula, n_layers=layers, d_model=width, seq_len=seq, attention=attention
        )

    hfu_flops = hfu_flops_per_token(model_flops, recompute, layers, width, seq, attention)
    attention_used = (
        attention
        if used_formula == "6N+12LHQT" or (recompute == "selective" and hfu_flops is not None)
        else None
    )

    canonical_dtype = normalize_dtype(dtype)
    device = device_name if device_name is not None else _detect_device_name(model)
    if peak_arg is not None:
        peak: float | None = peak_arg
        source: str | None = "user"
    else:
        found = lookup_peak(device, canonical_dtype)
        peak, source = found if found is not None else (None, None)
        if found is None:
            warn_unknown_peak(device, canonical_dtype)

    return Convention(
        formula=used_formula,
        attention=attention_used,
        flops_per_token=model_flops,
        hfu_flops_per_token=hfu_flops,
        recompute=recompute,
        n_params=n_used,
        embeddings_counted=embeddings_counted,
        n_layers=layers,
        d_model=width,
        seq_len=seq,
        dtype=canonical_dtype,
        device_name=device,
        peak_flops=peak,
        peak_source=source,
    )
