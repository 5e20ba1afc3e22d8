"""The ``"measured"`` convention: FLOPs per token counted by ``torch.utils.flop_counter``
over one forward and backward of the real model (torch is imported only when it runs)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["FlopsUnavailableError", "measure_flops_per_token"]


class FlopsUnavailableError(RuntimeError):
    """Nothing to count FLOPs from (no model, no ``n_params``, no ``flops_per_token``).

    Not a ``ValueError`` on purpose: ``stepwatch.init`` treats ``ValueError`` as a
    configuration mistake to raise, and this as "MFU unavailable" to warn about.
    """


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
