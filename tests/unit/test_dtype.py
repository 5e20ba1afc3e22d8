"""The dtype MFU is measured at, when init is not told (stepwatch._dtype), on real CPU
torch models. The TF32 rule needs CUDA parameters; only its switch is checked here."""

from __future__ import annotations

import warnings

import pytest
import torch

import stepwatch
from stepwatch import _dtype
from stepwatch.demo.launch import free_port
from stepwatch.flops import resolve_convention
from stepwatch.views.terminal import dtype_note


def test_given_wins_in_any_spelling() -> None:
    assert _dtype.resolve("bfloat16", torch.nn.Linear(4, 4)) == ("bf16", "given")
    assert _dtype.resolve("32-true", None) == ("fp32", "given")


def test_inferred_from_the_parameters() -> None:
    assert _dtype.resolve(None, torch.nn.Linear(4, 4)) == ("fp32", "parameters")
    assert _dtype.resolve(None, torch.nn.Linear(4, 4).to(torch.bfloat16)) == ("bf16", "parameters")
    mostly_half = torch.nn.Sequential(torch.nn.Linear(64, 64).half(), torch.nn.LayerNorm(64))
    assert _dtype.resolve(None, mostly_half) == ("fp16", "parameters")


def test_autocast_at_init_wins_over_fp32_parameters() -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _dtype.resolve(None, torch.nn.Linear(4, 4)) == ("bf16", "autocast")


def test_nothing_to_infer_from_is_said() -> None:
    with pytest.warns(RuntimeWarning, match="dtype not given"):
        assert _dtype.resolve(None, None) == ("bf16", "default")


def test_tf32_switch() -> None:
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert _dtype._tf32_matmuls(torch)
        torch.set_float32_matmul_precision("highest")
        assert _dtype._tf32_matmuls(torch) is bool(torch.backends.cuda.matmul.allow_tf32)
    finally:
        torch.set_float32_matmul_precision(before)


def test_init_records_the_dtype_and_follows_autocast_at_the_first_forward() -> None:
    model = torch.nn.Linear(8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sw = stepwatch.init(
            run="dtype", model=model, url=f"http://127.0.0.1:{free_port()}", rank=0, world_size=1, host="h"
        )
    try:
        conv = sw.convention
        assert conv is not None and (conv["dtype"], conv["dtype_source"]) == ("fp32", "parameters")
        assert "/fp32/" in conv["id"]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(2, 8))
        conv = sw.convention
        assert conv is not None and (conv["dtype"], conv["dtype_source"]) == ("bf16", "autocast")
        assert "/bf16/" in conv["id"] and dtype_note(conv) == " (dtype bf16 from autocast)"
        assert not model._forward_pre_hooks, "the hook removed itself"
    finally:
        sw.close(timeout_s=0.0)


def test_a_given_peak_is_kept_when_autocast_restates_the_dtype() -> None:
    conv = {"dtype": "fp32", "device_name": "cpu", "peak_flops": 1e12, "peak_source": "user"}
    base = resolve_convention(flops_per_token=1e6, dtype="fp32", peak_flops=1e12).to_dict()
    assert {k: base[k] for k in conv} == conv
    out = _dtype.with_dtype(base, "bf16", "autocast")
    assert (out["dtype"], out["peak_flops"], out["peak_source"], out["dtype_source"]) == (
        "bf16",
        1e12,
        "user",
        "autocast",
    )
