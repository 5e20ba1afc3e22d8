"""FLOPs per token by named formula, the parameter count N, and recomputation (HFU).

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
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._checks import choice, positive_int
from .convention import ATTENTIONS

if TYPE_CHECKING:
    import torch

__all__ = ["attention_term", "count_params", "flops_per_token", "hfu_flops_per_token"]


def attention_term(n_layers: int, d_model: int, seq_len: int, attention: str) -> float:
    """Training FLOPs per token of the attention score and context matmuls (12·L·d·T, halved if causal)."""
    factor = 12 if attention == "full" else 6
    return float(factor * n_layers * d_model * seq_len)


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
        return positive_int("active_params", active_params)
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
    n = positive_int("n_params", n_params)
    choice("attention", attention, ATTENTIONS)
    if formula == "6N":
        return 6.0 * n
    if formula == "6N+12LHQT":
        if n_layers is None or d_model is None or seq_len is None:
            raise ValueError("formula '6N+12LHQT' needs n_layers, d_model and seq_len")
        term = attention_term(
            positive_int("n_layers", n_layers),
            positive_int("d_model", d_model),
            positive_int("seq_len", seq_len),
            attention,
        )
        return 6.0 * n + term
    raise ValueError(f"flops_per_token computes formulas '6N' and '6N+12LHQT', not {formula!r}")


def hfu_flops_per_token(
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
    return model_flops + attention_term(n_layers, d_model, seq_len, attention) / 3.0
