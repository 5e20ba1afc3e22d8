"""Counting the non-padding tokens of a batch without synchronising the device.

Shared by the Lightning and Hugging Face callbacks. A batch's ``attention_mask`` (a
mapping key or an attribute) gives the real tokens and its shape the padded total;
without a mask, ``input_ids`` (or the first integer tensor of a tuple batch) counts every
position as real. ``tokens_fn(batch) -> int`` overrides all of that.

On the CPU the count is exact and immediate. On a CUDA device, reading a sum back would
synchronise the GPU, so the sum is started on the device and copied into pinned host
memory behind a CUDA event; the copy is read once its event has completed (``query()``),
usually at the next optimizer step. A step's count can arrive a step late, and the
counts still in flight when training ends are not reported.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

TokensFn = Callable[[Any], int]


def _field(batch: Any, name: str) -> Any:
    if isinstance(batch, Mapping):
        return batch.get(name)
    return getattr(batch, name, None)


def _first_int_tensor(batch: Any) -> Any:
    if isinstance(batch, list | tuple):
        for item in batch:
            dtype = getattr(item, "dtype", None)
            if dtype is not None and getattr(dtype, "is_floating_point", True) is False and item.dim() >= 2:
                return item
    return None


class TokenCounter:
    """Accumulates the tokens of the batches of one optimizer step; ``take()`` hands
    them to ``sw.step`` and starts the next step."""

    def __init__(self, tokens_fn: TokensFn | None = None) -> None:
        self._fn = tokens_fn
        self._tokens = 0
        self._padded = 0
        self._padded_seen = False
        self._pending: deque[tuple[Any, Any]] = deque()

    def add(self, batch: Any) -> None:
        if self._fn is not None:
            self._tokens += int(self._fn(batch))
            return
        mask = _field(batch, "attention_mask")
        if mask is not None and hasattr(mask, "sum"):
            self._padded += int(mask.numel())
            self._padded_seen = True
            if getattr(mask, "is_cuda", False):
                self._defer(mask.sum())
            else:
                self._tokens += int(mask.sum())
            return
        ids = _field(batch, "input_ids")
        if ids is None:
            ids = _first_int_tensor(batch)
        if ids is not None and hasattr(ids, "numel"):
            self._tokens += int(ids.numel())

    def _defer(self, total: Any) -> None:
        import torch

        host = torch.empty((), dtype=total.dtype, pin_memory=True)
        host.copy_(total, non_blocking=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        self._pending.append((event, host))

    def take(self) -> tuple[int, int | None]:
        """(tokens, padded tokens or None) of the batches added since the last take,
        plus any device counts whose copies have completed since."""
        tokens = self._tokens
        while self._pending and self._pending[0][0].query():
            _, host = self._pending.popleft()
            tokens += int(host)
        padded = self._padded if self._padded_seen else None
        self._tokens = self._padded = 0
        self._padded_seen = False
        return tokens, padded
