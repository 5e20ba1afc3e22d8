"""The Lightning and Hugging Face callbacks, each driving a real tiny training on the CPU
against a real collector over loopback: every optimizer step arrives, with the
non-padding tokens counted from the batches' attention masks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from stepwatch_server.storage import migrate

from ..live import serve_in_thread

SEQ, VOCAB = 16, 64


class PaddedText(Dataset[dict[str, torch.Tensor]]):
    """Right-padded random sequences of random length: real and padding tokens."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(n):
            length = int(torch.randint(SEQ // 2, SEQ + 1, (1,), generator=g))
            ids = torch.zeros(SEQ, dtype=torch.long)
            ids[:length] = torch.randint(1, VOCAB, (length,), generator=g)
            mask = (torch.arange(SEQ) < length).long()
            self.items.append({"input_ids": ids, "attention_mask": mask, "labels": ids.clone()})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.items[i]

    def real_tokens(self) -> int:
        return int(sum(int(x["attention_mask"].sum()) for x in self.items))


@pytest.fixture
def collector(tmp_path: Path) -> Any:
    url = f"sqlite:///{tmp_path / 'collector.db'}"
    migrate.upgrade(url)
    with serve_in_thread(url) as base:
        yield base


def _read(base: str, run: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    with httpx.Client(base_url=base, timeout=10) as c:
        ov = c.get(f"/api/v1/runs/{run}").raise_for_status().json()
        ranks = c.get(f"/api/v1/runs/{run}/ranks").raise_for_status().json()
    return ov, ranks


def test_lightning_callback_reports_each_optimizer_step(collector: str, tmp_path: Path) -> None:
    import lightning.pytorch as pl

    from stepwatch.integrations.lightning import StepwatchCallback

    class TinyLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(VOCAB, 32)
            self.head = torch.nn.Linear(32, VOCAB)

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            logits = self.head(self.emb(batch["input_ids"]))
            labels = batch["labels"].masked_fill(batch["attention_mask"] == 0, -100)
            return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    data = PaddedText(48)
    callback = StepwatchCallback(
        "pl-tiny", url=collector, seq_len=SEQ, peak_flops=1e11, send_interval_s=0.2, warmup_steps=1
    )
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        accumulate_grad_batches=2,  # 12 batches -> 6 optimizer steps
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(TinyLM(), DataLoader(data, batch_size=4))

    assert callback.sw is None, "the agent was closed (and flushed) when training ended"
    ov, ranks = _read(collector, "pl-tiny")
    assert (ov["steps_stored"], ov["first_step"], ov["last_step"]) == (6, 1, 6)
    assert ov["tokens_total"] == data.real_tokens(), "non-padding tokens from the attention masks"
    assert ov["padding_ratio"] == pytest.approx(1 - data.real_tokens() / (48 * SEQ))
    assert ov["convention"]["dtype"] == "fp32", "dtype from the trainer's precision (32-true)"
    assert ov["mfu"]["mean"] is not None and ov["mfu"]["mean"] > 0
    assert [(r["rank"], r["last_step"], r["dropped_windows"]) for r in ranks] == [(0, 6, 0)]


def test_hugging_face_callback_reports_each_optimizer_step(collector: str, tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from stepwatch.integrations.hf import StepwatchTrainerCallback

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2))
    data = PaddedText(40, seed=1)
    callback = StepwatchTrainerCallback(
        "hf-tiny", url=collector, seq_len=SEQ, peak_flops=1e11, send_interval_s=0.2, warmup_steps=1
    )
    args = TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        num_train_epochs=1,  # 40 samples / (4 x 2 accumulation) = 5 optimizer steps
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        logging_steps=2,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()

    assert callback.sw is None
    ov, ranks = _read(collector, "hf-tiny")
    assert (ov["steps_stored"], ov["first_step"], ov["last_step"]) == (5, 1, 5)
    assert ov["tokens_total"] == data.real_tokens(), "every training forward's attention mask, once"
    assert ov["padding_ratio"] == pytest.approx(1 - data.real_tokens() / (40 * SEQ))
    conv = ov["convention"]
    assert conv["formula"] == "6N+12LHQT", "layers and width read from the GPT-2 config"
    assert conv["dtype"] == "fp32"
    assert [(r["rank"], r["last_step"], r["dropped_windows"]) for r in ranks] == [(0, 5, 0)]
