"""Hugging Face ``TrainerCallback``: ``Trainer(..., callbacks=[StepwatchTrainerCallback(run="my-run")])``.

The Trainer does not hand its batches to callbacks, so the tokens are counted by a
forward pre-hook on the model (training forwards only) that reads ``attention_mask`` /
``input_ids`` from the model's inputs. The data-loader wait is the gap between the end
of the previous step (or of the logging, evaluation or saving that followed it) and
``on_step_begin``, which the Trainer calls once it has fetched the step's batches.
"""

from __future__ import annotations

import time
from typing import Any

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("stepwatch.integrations.hf needs transformers: pip install 'stepwatch[hf]'") from exc

import stepwatch

from ._tokens import TokenCounter, TokensFn


def dtype_of(args: TrainingArguments) -> str:
    if getattr(args, "bf16", False):
        return "bf16"
    if getattr(args, "fp16", False):
        return "fp16"
    return "fp32"


class StepwatchTrainerCallback(TrainerCallback):
    """Reports every optimizer step of a Hugging Face ``Trainer`` to a stepwatch collector.

    ``run`` and any keyword of :func:`stepwatch.init` (``seq_len``, ``url``, ``peak_flops``,
    ...) are passed through; rank and world size come from the ``TrainingArguments``, the
    model (and its ``config``, for the FLOPs formula) from the Trainer, the dtype from
    ``bf16``/``fp16`` unless given. ``tokens_fn(inputs) -> int`` replaces the default count.
    """

    def __init__(
        self, run: str | None = None, *, tokens_fn: TokensFn | None = None, **init_kwargs: Any
    ) -> None:
        self.run = run
        self.init_kwargs = init_kwargs
        self.sw: stepwatch.Stepwatch | None = None
        self._tokens = TokenCounter(tokens_fn)
        self._hook: Any = None
        self._idle_since: float | None = None

    def _count(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if module.training:
            self._tokens.add(kwargs if kwargs else (args[0] if args else None))

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: Any = None,
        **_: Any,
    ) -> None:
        kwargs = {"dtype": dtype_of(args), "model": model, **self.init_kwargs}
        self.sw = stepwatch.init(
            self.run,
            rank=args.process_index,
            local_rank=max(args.local_process_index, 0),
            world_size=args.world_size,
            start_step=state.global_step,
            **kwargs,
        )
        if model is not None and self._hook is None:
            self._hook = model.register_forward_pre_hook(self._count, with_kwargs=True)
        self._idle_since = None

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any
    ) -> None:
        if self.sw is not None and self._idle_since is not None:
            self.sw.add_data_wait(time.perf_counter() - self._idle_since)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any
    ) -> None:
        if self.sw is None:
            return
        tokens, padded = self._tokens.take()
        self.sw.step(tokens=tokens, padded_tokens=padded)
        self._idle_since = time.perf_counter()

    def _after_pause(self) -> None:
        if self._idle_since is not None:
            self._idle_since = time.perf_counter()

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any) -> None:
        self._after_pause()

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any
    ) -> None:
        if self.sw is not None:
            self.sw.mark("eval")  # the evaluation falls inside the next step's interval
        self._after_pause()

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any
    ) -> None:
        if self.sw is not None:
            self.sw.mark("checkpoint")
        self._after_pause()

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any
    ) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.sw is not None:
            self.sw.close()
            self.sw = None
