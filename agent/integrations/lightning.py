"""PyTorch Lightning callback: ``Trainer(callbacks=[StepwatchCallback(run="my-run")])``.

One ``sw.step`` per optimizer step (``trainer.global_step`` advancing), so gradient
accumulation and manual optimisation count correctly. The data-loader wait is the gap
between the end of one training batch (or of a validation loop) and the start of the
next, which is where Lightning fetches the batch and moves it to the device.
"""

from __future__ import annotations

import time
from typing import Any

try:
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.callbacks import Callback
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "stepwatch.integrations.lightning needs PyTorch Lightning: pip install 'stepwatch[lightning]'"
    ) from exc

import stepwatch

from ._tokens import TokenCounter, TokensFn

_PRECISION_DTYPE = {"bf16": "bf16", "16": "fp16", "32": "fp32", "64": "fp64", "transformer-engine": "fp8"}


def dtype_of(precision: object) -> str:
    """stepwatch's training dtype for a Lightning precision ("bf16-mixed" -> "bf16")."""
    head = str(precision).split("-")[0]
    return _PRECISION_DTYPE.get(head, "fp32")


class StepwatchCallback(Callback):
    """Reports every optimizer step of a Lightning ``Trainer`` to a stepwatch collector.

    ``run`` and any keyword of :func:`stepwatch.init` (``seq_len``, ``url``, ``peak_flops``,
    ``flops_per_token``, ...) are passed through; rank, world size and start step come from
    the trainer, the model from the LightningModule, the dtype from the trainer's
    precision unless given. ``tokens_fn(batch) -> int`` replaces the default token count.
    """

    def __init__(
        self, run: str | None = None, *, tokens_fn: TokensFn | None = None, **init_kwargs: Any
    ) -> None:
        super().__init__()
        self.run = run
        self.init_kwargs = init_kwargs
        self.sw: stepwatch.Stepwatch | None = None
        self._tokens = TokenCounter(tokens_fn)
        self._global_step = 0
        self._idle_since: float | None = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        kwargs = {"dtype": dtype_of(trainer.precision), "model": pl_module, **self.init_kwargs}
        self.sw = stepwatch.init(
            self.run,
            rank=trainer.global_rank,
            local_rank=trainer.local_rank,
            world_size=trainer.world_size,
            start_step=trainer.global_step,
            **kwargs,
        )
        self._global_step = trainer.global_step
        self._idle_since = None

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.sw is not None and self._idle_since is not None:
            self.sw.add_data_wait(time.perf_counter() - self._idle_since)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.sw is None:
            return
        self._tokens.add(batch)
        if trainer.global_step != self._global_step:  # an optimizer step happened in this batch
            self._global_step = trainer.global_step
            tokens, padded = self._tokens.take()
            self.sw.step(tokens=tokens, padded_tokens=padded)
        self._idle_since = time.perf_counter()

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.sw is not None and trainer.training:
            self.sw.mark("eval")  # the step in progress contains an evaluation

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._idle_since is not None:
            self._idle_since = time.perf_counter()  # evaluation is not data-loader wait

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self.sw is not None:
            self.sw.mark("checkpoint")

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._close()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self.sw is not None:
            self.sw.close()
            self.sw = None
