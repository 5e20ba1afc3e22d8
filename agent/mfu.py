"""Model FLOPs utilisation (MFU) with provenance.

An MFU figure is only comparable with another when both used the same FLOPs-per-token
formula, the same parameter count convention and the same peak. This module therefore
never hands out a bare number: :func:`resolve_convention` fixes the choices once, at
``stepwatch.init``, into a frozen :class:`Convention` whose :attr:`Convention.id` (formula,
attention, dtype, device, peak and the source of that peak) travels with every payload and
is stored with the run.

Definitions (DESIGN §3)
-----------------------
``MFU = model FLOPs/s achieved / (n_devices x dense peak FLOP/s of one device at the dtype)``,
a 0-1 ratio. Model FLOPs exclude activation recomputation; hardware FLOPs (HFU) include it
and are reported only when a recompute mode is given. An unknown device gives MFU ``None``
and one warning, never the peak of some other chip (as Lightning's ``throughput.py`` does).

FLOPs-per-token conventions (training: forward + backward, 2 FLOPs per multiply-add)
-----------------------------------------------------------------------------------
``"6N"``
    Kaplan et al. 2020: each parameter costs 2 FLOPs per token forward and 4 backward.
    Ignores the attention score/context matmuls, which grow with sequence length.
``"6N+12LHQT"``
    PaLM (Chowdhery et al. 2022, Appendix B): ``6N + 12·L·H·Q·T`` with L layers, H heads,
    Q head dim (``d_model = H·Q``) and T the sequence length. The 12 is 2 matmuls (QKᵀ and
    AV) x 2 FLOPs per MAC x 3 (forward + 2x backward) over the full T x T score matrix:
    ``attention="full"``. With ``attention="causal"`` only the lower triangle is computed by
    causal kernels (FlashAttention skips masked blocks), so the term is halved to
    ``6·L·H·Q·T``: the convention of FlashAttention's ``benchmarks/benchmark_flash_attention.py``
    (``flops(..., causal)`` divides by 2), of Meta Lingua's ``get_num_flop_per_token`` and of
    NeMo's later ``nemo/utils/flops_formulas.py`` (``0.5 if causal_self_attn``). Many
    published figures do *not* halve it even for causal models: PaLM, llm-foundry's
    ``collect_results.py``, torchtitan's ``get_num_flop_per_token`` ("we follow the convention
    and do not account for sparsity in causal attention") and NeMo 24.07's ``llama3``
    formula. Reproduce those with ``attention="full"``.
``"explicit"``
    A FLOPs-per-token value given by the user (e.g. from their framework's own formula).
``"measured"``
    Counted once at init by ``torch.utils.flop_counter.FlopCounterMode`` over one forward and
    backward of the real model on a sample batch (see :func:`measure_flops_per_token`).

N is counted by :func:`count_params`, non-embedding by default (Kaplan et al. 2020), and the
convention says which (``embeddings_counted``). For mixture-of-experts models pass the
*active* parameter count per token (``active_params``): only the routed experts run.

Recomputation (HFU)
-------------------
``recompute="full"`` (activation checkpointing of whole layers) re-runs the forward pass
once in the backward: 8N instead of 6N and the attention term grows by the same 4/3, i.e.
hardware FLOPs = 4/3 x model FLOPs (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", §6; llm-foundry computes HFU exactly so).
``recompute="selective"`` recomputes only the attention core (QKᵀ, softmax, AV; Korthikanti
et al. 2022 §4.2), adding one forward of the attention matmuls, ``4·L·H·Q·T`` per token
(``2·L·H·Q·T`` when causal); it needs L, d_model and T, otherwise HFU stays ``None``.
"""

from __future__ import annotations

import math
import numbers
import operator
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, SupportsIndex

from ._peaks import find_row, normalize_dtype

if TYPE_CHECKING:
    import torch

__all__ = [
    "ATTENTIONS",
    "FORMULAS",
    "RECOMPUTES",
    "Convention",
    "FlopsUnavailableError",
    "UnknownPeakWarning",
    "count_params",
    "flops_per_token",
    "lookup_peak",
    "measure_flops_per_token",
    "resolve_convention",
]

FORMULAS: tuple[str, ...] = ("6N", "6N+12LHQT", "explicit", "measured")
ATTENTIONS: tuple[str, ...] = ("full", "causal")
RECOMPUTES: tuple[str, ...] = ("full", "selective")


class UnknownPeakWarning(UserWarning):
    """No dense peak is known for this device and dtype: MFU will be null."""


class FlopsUnavailableError(RuntimeError):
    """Nothing to count FLOPs from (no model, no ``n_params``, no ``flops_per_token``).

    Not a ``ValueError`` on purpose: ``stepwatch.init`` treats ``ValueError`` as a
    configuration mistake to raise, and this as "MFU unavailable" to warn about.
    """


# ----------------------------------------------------------------------------- helpers


def _positive_int(name: str, value: object) -> int:
    # Int-like values (numpy integers) are accepted; floats, strings and bools are not.
    number = operator.index(value) if isinstance(value, SupportsIndex) else 0
    if isinstance(value, bool) or number <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return number


def _opt_positive_int(name: str, value: object) -> int | None:
    return None if value is None else _positive_int(name, value)


def _positive_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    number = float(value)
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return number


def _opt_positive_float(name: str, value: object) -> float | None:
    return None if value is None else _positive_float(name, value)


def _opt_str(name: str, value: object) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{name} must be a string or null, got {value!r}")
    return value


def _choice(name: str, value: object, allowed: Sequence[str | None]) -> str | None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)!r}, got {value!r}")
    return value if value is None else str(value)


def _attention_term(n_layers: int, d_model: int, seq_len: int, attention: str) -> float:
    """Training FLOPs per token of the attention score and context matmuls (12·L·d·T, halved if causal)."""
    factor = 12 if attention == "full" else 6
    return float(factor * n_layers * d_model * seq_len)


def _fmt_tflops(flops: float) -> str:
    return f"{round(flops / 1e12, 3):g}"


# ----------------------------------------------------------------------------- Convention


@dataclass(frozen=True)
class Convention:
    """The choices behind an MFU number, frozen at init and stored with the run.

    ``flops_per_token`` is model FLOPs per (real) token for one training step, forward and
    backward; ``hfu_flops_per_token`` adds recomputation. ``peak_flops`` is the dense peak
    of ONE device at ``dtype`` and ``peak_source`` cites where it comes from (a table row,
    or ``"user"``). See the module docstring for what each formula means.
    """

    formula: str
    attention: str | None
    flops_per_token: float
    hfu_flops_per_token: float | None
    recompute: str | None
    n_params: int | None
    embeddings_counted: bool
    n_layers: int | None
    d_model: int | None
    seq_len: int | None
    dtype: str
    device_name: str | None
    peak_flops: float | None
    peak_source: str | None

    def __post_init__(self) -> None:
        # Validated here too so that a Convention read back from storage is as sound as one
        # built by resolve_convention.
        _choice("formula", self.formula, FORMULAS)
        _choice("attention", self.attention, (None, *ATTENTIONS))
        _choice("recompute", self.recompute, (None, *RECOMPUTES))
        _positive_float("flops_per_token", self.flops_per_token)
        _opt_positive_float("hfu_flops_per_token", self.hfu_flops_per_token)
        _opt_positive_int("n_params", self.n_params)
        _opt_positive_int("n_layers", self.n_layers)
        _opt_positive_int("d_model", self.d_model)
        _opt_positive_int("seq_len", self.seq_len)
        _opt_positive_float("peak_flops", self.peak_flops)
        if not isinstance(self.embeddings_counted, bool):
            raise ValueError(f"embeddings_counted must be a bool, got {self.embeddings_counted!r}")
        if not isinstance(self.dtype, str) or not self.dtype:
            raise ValueError(f"dtype must be a non-empty string, got {self.dtype!r}")
        _opt_str("device_name", self.device_name)
        _opt_str("peak_source", self.peak_source)
        if self.formula == "6N+12LHQT" and self.attention is None:
            raise ValueError("formula '6N+12LHQT' needs attention 'full' or 'causal'")
        if (self.peak_flops is None) != (self.peak_source is None):
            raise ValueError("peak_flops and peak_source must be both set or both null")

    @property
    def id(self) -> str:
        """Short stable human-readable id: formula(attention)/dtype/device@peak[source].

        e.g. ``"6N+12LHQT(causal)/bf16/NVIDIA H100 80GB HBM3@989.4TFLOPs[NVIDIA H100 datasheet]"``;
        ``"...@unknown"`` when no peak is known (MFU null).
        """
        formula = f"6N+12LHQT({self.attention})" if self.formula == "6N+12LHQT" else self.formula
        device = self.device_name if self.device_name is not None else "unknown-device"
        if self.peak_flops is None:
            peak = "unknown"
        else:
            peak = f"{_fmt_tflops(self.peak_flops)}TFLOPs[{self.peak_source}]"
        return f"{formula}/{self.dtype}/{device}@{peak}"

    def to_dict(self) -> dict[str, object]:
        """JSON-serialisable form: every field plus ``"id"``."""
        out: dict[str, object] = asdict(self)
        out["id"] = self.id
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> Convention:
        """Inverse of :meth:`to_dict`. ``"id"`` and unknown keys are ignored (the id is derived).

        Raises ``ValueError`` naming the field when one is missing or invalid.
        """
        missing = [f.name for f in fields(cls) if f.name not in d]
        if missing:
            raise ValueError(f"convention lacks field(s) {missing}")

        def number(name: str) -> float | None:
            value = d[name]
            if value is None:
                return None
            return _positive_float(name, value)

        def integer(name: str) -> int | None:
            return _opt_positive_int(name, d[name])

        def text(name: str) -> str | None:
            return _opt_str(name, d[name])

        flops = number("flops_per_token")
        if flops is None:
            raise ValueError("flops_per_token must not be null")
        formula, dtype, embeddings = text("formula"), text("dtype"), d["embeddings_counted"]
        if formula is None or dtype is None:
            raise ValueError("formula and dtype must not be null")
        if not isinstance(embeddings, bool):
            raise ValueError(f"embeddings_counted must be a bool, got {embeddings!r}")
        return cls(
            formula=formula,
            attention=text("attention"),
            flops_per_token=flops,
            hfu_flops_per_token=number("hfu_flops_per_token"),
            recompute=text("recompute"),
            n_params=integer("n_params"),
            embeddings_counted=embeddings,
            n_layers=integer("n_layers"),
            d_model=integer("d_model"),
            seq_len=integer("seq_len"),
            dtype=dtype,
            device_name=text("device_name"),
            peak_flops=number("peak_flops"),
            peak_source=text("peak_source"),
        )

    def flops_per_device(self, tokens_per_s: float, n_devices: int) -> float:
        """Achieved model FLOP/s per device ("model TFLOP/s per GPU" in NeMo's tables).

        ``tokens_per_s`` is the job's global rate (summed over data-parallel replicas, each
        token counted once, DESIGN §3); ``n_devices`` every device of the job.
        """
        if isinstance(n_devices, bool) or not isinstance(n_devices, int) or n_devices < 1:
            raise ValueError(f"n_devices must be an int >= 1, got {n_devices!r}")
        if not (math.isfinite(tokens_per_s) and tokens_per_s >= 0):
            raise ValueError(f"tokens_per_s must be finite and >= 0, got {tokens_per_s!r}")
        return self.flops_per_token * tokens_per_s / n_devices

    def mfu(self, tokens_per_s: float, n_devices: int) -> float | None:
        """Model FLOPs utilisation as a 0-1 ratio, or ``None`` when the peak is unknown."""
        achieved = self.flops_per_device(tokens_per_s, n_devices)
        if self.peak_flops is None:
            return None
        return achieved / self.peak_flops

    def hfu(self, tokens_per_s: float, n_devices: int) -> float | None:
        """Hardware FLOPs utilisation (with recomputation), or ``None`` if unknown."""
        achieved = self.flops_per_device(tokens_per_s, n_devices)
        if self.peak_flops is None or self.hfu_flops_per_token is None:
            return None
        return achieved * (self.hfu_flops_per_token / self.flops_per_token) / self.peak_flops


# ----------------------------------------------------------------------------- counting


def count_params(
    model: torch.nn.Module, *, exclude_embeddings: bool = True, active_params: int | None = None
) -> int:
    """N for the 6N formulas.

    Parameters shared between modules (tied input/output embeddings) are counted once.
    ``exclude_embeddings`` drops the parameters of every ``nn.Embedding``/``nn.EmbeddingBag``
    (token and learned position tables; Kaplan et al. 2020's non-embedding N), which are
    lookups, not matmuls. Note that with tied weights the output projection *is* the token
    embedding, so it is dropped too although its matmul runs; count embeddings (or use
    ``formula="measured"``) for such models if that matters at your vocabulary size.

    ``active_params`` is returned as is when given: for a mixture-of-experts model only the
    caller knows how many parameters one token passes through (shared + top-k experts);
    give it with the same embedding convention.

    Count before sharding (FSDP1 flat parameters report the local shard) or pass ``n_params``.
    """
    if active_params is not None:
        return _positive_int("active_params", active_params)
    import torch.nn as nn

    embedding_ids: set[int] = set()
    if exclude_embeddings:
        for module in model.modules():
            if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
                embedding_ids.update(id(p) for p in module.parameters(recurse=False))
    total = 0
    for param in model.parameters():  # de-duplicates shared parameters
        if id(param) not in embedding_ids:
            total += int(param.numel())
    return total


def flops_per_token(
    n_params: int,
    *,
    formula: str,
    n_layers: int | None = None,
    d_model: int | None = None,
    seq_len: int | None = None,
    attention: str = "causal",
) -> float:
    """Training (forward + backward) model FLOPs per token by a named formula.

    ``"6N"`` -> ``6·N``; ``"6N+12LHQT"`` -> ``6·N + 12·L·d·T`` with ``attention="full"``,
    ``6·N + 6·L·d·T`` with ``attention="causal"`` (see the module docstring for why and who
    uses which). ``d_model`` is H·Q, the width of the attention (heads x head dim).
    """
    n = _positive_int("n_params", n_params)
    _choice("attention", attention, ATTENTIONS)
    if formula == "6N":
        return 6.0 * n
    if formula == "6N+12LHQT":
        if n_layers is None or d_model is None or seq_len is None:
            raise ValueError("formula '6N+12LHQT' needs n_layers, d_model and seq_len")
        term = _attention_term(
            _positive_int("n_layers", n_layers),
            _positive_int("d_model", d_model),
            _positive_int("seq_len", seq_len),
            attention,
        )
        return 6.0 * n + term
    raise ValueError(f"flops_per_token computes formulas '6N' and '6N+12LHQT', not {formula!r}")


def _hfu_flops_per_token(
    model_flops: float,
    recompute: str | None,
    n_layers: int | None,
    d_model: int | None,
    seq_len: int | None,
    attention: str,
) -> float | None:
    """Hardware FLOPs per token: model FLOPs plus what recomputation runs again."""
    if recompute is None:
        return None
    if recompute == "full":
        # One more forward of everything; forward is 1/3 of forward+backward.
        return model_flops * 4.0 / 3.0
    if n_layers is None or d_model is None or seq_len is None:
        return None
    # Selective: one more forward of QK^T and AV (2 matmuls x 2 FLOPs/MAC), halved if causal.
    return model_flops + _attention_term(n_layers, d_model, seq_len, attention) / 3.0


def lookup_peak(device_name: str, dtype: str) -> tuple[float, str] | None:
    """Dense peak FLOP/s of one device at ``dtype`` and its source, or ``None`` if unknown."""
    row = find_row(device_name)
    if row is None:
        return None
    flops = row.flops.get(normalize_dtype(dtype))
    if flops is None:
        return None
    return flops, row.source


_warned_lock = threading.Lock()
_warned: set[tuple[str, str]] = set()


def _warn_unknown_peak(device_name: str, dtype: str) -> None:
    """One warning per process per (device, dtype): a training job inits many times (restarts, tests)."""
    key = (device_name, dtype)
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(
        f"stepwatch: no dense peak FLOP/s known for device {device_name!r} at dtype {dtype!r}; "
        "MFU will be null. Pass peak_flops=<dense FLOP/s of one device> to stepwatch.init "
        "to set it.",
        UnknownPeakWarning,
        stacklevel=3,
    )


# ----------------------------------------------------------------------------- discovery


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


# ----------------------------------------------------------------------------- measured


def _first_tensor(batch: object) -> torch.Tensor:
    import torch

    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, Mapping):
        ids = batch.get("input_ids")
        if isinstance(ids, torch.Tensor):
            return ids
        for value in batch.values():
            if isinstance(value, torch.Tensor):
                return value
    if isinstance(batch, (tuple, list)):
        for value in batch:
            if isinstance(value, torch.Tensor):
                return value
    raise TypeError(f"cannot find the token tensor in a sample batch of type {type(batch).__name__}")


def _count_tokens(batch: object) -> int:
    """Token positions in the batch: all elements of integer token ids, all but the last
    dimension of floating inputs (``(B, T, features)``). Padding counts: it is computed."""
    tensor = _first_tensor(batch)
    if tensor.is_floating_point() and tensor.dim() >= 2:
        return int(tensor.numel() // tensor.shape[-1])
    return int(tensor.numel())


def _call_model(model: Callable[..., Any], batch: object) -> Any:
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _default_loss(output: object) -> torch.Tensor:
    """A scalar to differentiate: the model's own loss if it returns one, else a sum of its output.

    The sum adds no matmul FLOPs, so the count is the model's forward and backward only.
    """
    import torch

    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 else output.float().sum()
    for name in ("loss", "logits"):
        value = output.get(name) if isinstance(output, Mapping) else getattr(output, name, None)
        if isinstance(value, torch.Tensor):
            return _default_loss(value)
    if isinstance(output, (tuple, list)) and output:
        return _default_loss(output[0])
    raise TypeError(f"cannot make a loss from model output of type {type(output).__name__}; pass loss_fn=")


_SDPA_BACKWARD_OPS = (  # (grad_out, query, key, value, ...): shapes are enough
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_cudnn_attention_backward",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
)
_RAW_ATTENTION_BACKWARD_OPS = ("_flash_attention_backward", "_efficient_attention_backward")


def _model_flops_formulas() -> dict[Any, Any]:
    """``FlopCounterMode`` overrides that make the attention count *model* FLOPs.

    Two corrections to PyTorch's registry (checked against torch 2.13):

    * the fused CPU kernel ``_scaled_dot_product_flash_attention_for_cpu`` (what
      ``scaled_dot_product_attention`` runs on CPU) has no formula, so its matmuls would
      count as zero; we give it PyTorch's own SDPA shape formula;
    * PyTorch's SDPA backward formula counts 5 matmuls, including the recomputation of QKᵀ
      that fused kernels do instead of storing the score matrix. Recomputation is excluded
      from model FLOPs (DESIGN §3; torchtitan's formula comment says the same of flash
      attention), so backward is counted as the 4 gradient matmuls, twice the forward.
      For the varlen kernels, whose formulas read raw arguments, we scale by 4/5, which is
      exact when the query and value head dims are equal.
    """
    import torch
    from torch.utils import flop_counter

    aten = torch.ops.aten
    forward_count: Any = getattr(flop_counter, "sdpa_flop_count", None)
    registry: Mapping[Any, Any] = getattr(flop_counter, "flop_registry", {})
    if forward_count is None:
        return {}
    mapping: dict[Any, Any] = {}

    def forward(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        return int(forward_count(query, key, value))

    def backward(
        grad_out: Any, query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any
    ) -> int:
        return 2 * int(forward_count(query, key, value))

    cpu_forward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if cpu_forward is not None:
        mapping[cpu_forward] = forward
    for name in _SDPA_BACKWARD_OPS:
        op = getattr(aten, name, None)
        if op is not None:
            mapping[op] = backward
    for name in _RAW_ATTENTION_BACKWARD_OPS:
        op = getattr(aten, name, None)
        formula = registry.get(op) if op is not None else None
        if formula is not None:
            mapping[op] = _four_fifths(formula)
    return mapping


def _four_fifths(formula: Callable[..., Any]) -> Callable[..., int]:
    def scaled(*args: Any, **kwargs: Any) -> int:
        return int(formula(*args, **kwargs)) * 4 // 5

    scaled.__dict__["_get_raw"] = True  # FlopCounterMode then passes raw arguments, as `formula` expects
    return scaled


def measure_flops_per_token(
    model: torch.nn.Module,
    sample_batch: object,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> float:
    """FLOPs per token of one forward and backward, counted by ``torch.utils.flop_counter``.

    Runs ``model`` once on ``sample_batch`` (a tensor of token ids, a tuple/list of
    positional inputs, or a mapping of keyword inputs) under ``FlopCounterMode``, computes
    ``loss_fn(output)`` (default: the model's own loss or a sum of its output) and its
    gradients with ``torch.autograd.grad`` (so no ``.grad`` is left behind), and divides the
    total by the token positions in the batch.

    What it counts: matmul-class ops only (mm, addmm, bmm, convolutions, SDPA), 2 FLOPs per
    multiply-add, as the formulas do; elementwise work (norms, activations, softmax, bias
    adds) is not counted. Attention is counted as model FLOPs (see
    :func:`_model_flops_formulas`: the fused CPU kernel is added, the QKᵀ recomputation in
    fused backward kernels removed). Causal masking is not discounted (PyTorch's counter
    does not), so the result matches ``"6N+12LHQT"`` with ``attention="full"``.
    Activation checkpointing inside the model is counted as run (so it can read above
    model FLOPs); measure on the model before wrapping it for recomputation.

    Use a batch at the training sequence length (the attention term depends on it); a
    batch of one sequence is enough. It costs one training step of time and memory, once.
    """
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    n_tokens = _count_tokens(sample_batch)
    if n_tokens <= 0:
        raise ValueError("the sample batch holds no tokens")
    params = [p for p in model.parameters() if p.requires_grad]
    counter = FlopCounterMode(display=False, custom_mapping=_model_flops_formulas())
    with torch.enable_grad(), counter:
        output = _call_model(model, sample_batch)
        loss = loss_fn(output) if loss_fn is not None else _default_loss(output)
        if params:
            torch.autograd.grad(loss, params, allow_unused=True)
    total = float(counter.get_total_flops())
    if total <= 0:
        raise ValueError("FlopCounterMode counted no FLOPs for this model and batch")
    return total / n_tokens


# ----------------------------------------------------------------------------- resolve


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
    _choice("formula", formula, ("auto", *FORMULAS))
    _choice("attention", attention, ATTENTIONS)
    _choice("recompute", recompute, (None, *RECOMPUTES))
    seq = _opt_positive_int("seq_len", seq_len)
    layers = _opt_positive_int("n_layers", n_layers)
    width = _opt_positive_int("d_model", d_model)
    peak_arg = _opt_positive_float("peak_flops", peak_flops)
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
        model_flops = _positive_float("flops_per_token", flops_per_token)
    elif formula == "explicit":
        raise ValueError("formula='explicit' needs flops_per_token=")
    elif formula == "measured":
        if model is None or sample_batch is None:
            raise ValueError("formula='measured' needs model= and sample_batch= (or flops_per_token=)")
        used_formula = "measured"
        model_flops = measure_flops_per_token(model, sample_batch, loss_fn=loss_fn)
    else:
        if active_params is not None:
            n_used = _positive_int("active_params", active_params)
        elif n_params is not None:
            n_used = _positive_int("n_params", n_params)
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
        model_flops = _formula_flops(
            n_used, formula=used_formula, n_layers=layers, d_model=width, seq_len=seq, attention=attention
        )

    hfu_flops = _hfu_flops_per_token(model_flops, recompute, layers, width, seq, attention)
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
            _warn_unknown_peak(device, canonical_dtype)

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


_formula_flops = flops_per_token  # resolve_convention's parameter shadows the public name
