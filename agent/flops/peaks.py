"""Dense peak FLOP/s of one accelerator, by device name and training dtype.

Why a table and not a guess: MFU divides by this number, so a wrong peak makes every
MFU of the run wrong by the same factor, silently. Each row therefore names the document
its numbers come from, and a device that matches no row yields ``None`` (MFU is reported
as null), never the numbers of some other chip.

Conventions used for every row:

* **Dense, not sparse.** NVIDIA datasheets print tensor-core figures "with sparsity"
  (2:4 structured sparsity) and mark them with an asterisk; the dense peak is half of
  that figure (H100 SXM BF16: 1,979 TFLOP/s sparse -> 989.4 dense, the value printed in
  the Hopper architecture whitepaper). Training never runs 2:4 sparse, so only dense
  figures are used.
* **One device as PyTorch sees it.** An AMD MI250X module holds two GCDs and each GCD is
  a separate ``torch.cuda`` device, so the MI250X row is half of the module figure.
  Grace-Blackwell rows are per B200-class GPU, not per superchip or rack.
* **``fp32``** means IEEE FP32 matmuls (no tensor cores); say ``tf32`` when
  ``torch.backends.cuda.matmul.allow_tf32`` (or ``set_float32_matmul_precision``) lets
  matmuls use TF32 tensor cores, as it is a different peak.
* **``fp8``** rows exist only where the hardware has FP8 tensor cores (Hopper, Ada,
  Blackwell, MI300). An FP8 run on an A100 has no FP8 peak: it gets ``None``.

Names are matched with regular expressions against ``torch.cuda.get_device_name()``
(for example ``"NVIDIA H100 80GB HBM3"``, ``"NVIDIA A100-SXM4-80GB"``, ``"NVIDIA H200"``,
``"AMD Instinct MI300X"``), case-insensitively, first match wins, so more specific rows
(``H100 NVL``, ``H100 PCIe``, ``GB200``) come before the general ones (``H100``, ``B200``).
Word boundaries keep ``L4`` from matching ``L40S`` and ``A10`` from matching ``A100``.
"""

from __future__ import annotations

import re
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "PEAKS",
    "PeakRow",
    "UnknownPeakWarning",
    "find_row",
    "lookup_peak",
    "normalize_dtype",
    "warn_unknown_peak",
]

_T = 1e12  # TFLOP/s -> FLOP/s

_DTYPE_ALIASES: dict[str, str] = {
    # canonical names
    "fp64": "fp64",
    "fp32": "fp32",
    "tf32": "tf32",
    "bf16": "bf16",
    "fp16": "fp16",
    "fp8": "fp8",
    "int8": "int8",
    # torch dtype names (str(torch.bfloat16) == "torch.bfloat16")
    "float64": "fp64",
    "double": "fp64",
    "float32": "fp32",
    "float": "fp32",
    "tfloat32": "tf32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float8": "fp8",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
    # Composer / llm-foundry precision names
    "amp_bf16": "bf16",
    "amp_fp16": "fp16",
    "amp_fp8": "fp8",
    # Lightning precision names
    "64-true": "fp64",
    "32-true": "fp32",
    "bf16-mixed": "bf16",
    "bf16-true": "bf16",
    "16-mixed": "fp16",
    "16-true": "fp16",
    "transformer-engine": "fp8",
}


def normalize_dtype(dtype: object) -> str:
    """Map a dtype spelling (``"bfloat16"``, ``torch.bfloat16``, ``"amp_bf16"``, ...) to a table key.

    Unknown spellings are returned lower-cased rather than rejected: they simply match no
    table column, which gives an unknown peak (MFU null) instead of an error at start-up.
    """
    text = str(dtype).strip().lower()
    if text.startswith("torch."):
        text = text[len("torch.") :]
    return _DTYPE_ALIASES.get(text, text)


@dataclass(frozen=True)
class PeakRow:
    """One device family: how to recognise it, its dense peaks per dtype, and where they come from."""

    chip: str
    pattern: re.Pattern[str]
    flops: Mapping[str, float]
    source: str


def _row(chip: str, pattern: str, source: str, **tflops: float) -> PeakRow:
    return PeakRow(
        chip=chip,
        pattern=re.compile(pattern, re.IGNORECASE),
        flops={dtype: value * _T for dtype, value in tflops.items()},
        source=source,
    )


# Hopper dies: H100 SXM5, H200 and H800 SXM share the tensor-core peak (the H800 differs
# only in NVLink bandwidth). Hopper whitepaper table "H100 SXM5": FP64 tensor 66.9,
# FP32 66.9, TF32 494.7, BF16/FP16 989.4, FP8 1978.9 (dense; the datasheet doubles them).
_HOPPER_SXM = {"fp64": 66.9, "fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9}
# H100 PCIe (and H800 PCIe): datasheet TF32 756*, BF16 1,513*, FP8 3,026* (sparse); FP32 51.
_HOPPER_PCIE = {"fp64": 51.0, "fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0, "fp8": 1513.0}
# H100 NVL / H200 NVL, per GPU: datasheet TF32 835*, BF16 1,671*, FP8 3,341* (sparse); FP32 60.
# (The first H100 NVL datasheet printed figures for a two-GPU pair; these are per GPU.)
_HOPPER_NVL = {"fp64": 60.0, "fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5}
# A100 / A800 (SXM4 and PCIe, 40 and 80 GB have the same peaks): TF32 156, BF16/FP16 312
# dense (624 sparse), FP32 19.5, FP64 tensor 19.5. No FP8.
_AMPERE_A100 = {"fp64": 19.5, "fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}

PEAKS: tuple[PeakRow, ...] = (
    # --- NVIDIA Blackwell ---------------------------------------------------------------
    # GB200 NVL72 datasheet (72 GPUs): FP16/BF16 360 PF*, FP8 720 PF*, TF32 180 PF* (sparse),
    # FP32 5,760 TF -> per GPU dense: 2,500 / 5,000 / 1,250 / 80 TFLOP/s.
    _row(
        "GB200",
        r"\bGB200\b",
        "NVIDIA GB200 NVL72 datasheet, per GPU",
        fp32=80.0,
        tf32=1250.0,
        bf16=2500.0,
        fp16=2500.0,
        fp8=5000.0,
    ),
    # HGX B200 datasheet (8 GPUs): FP16/BF16 36 PF*, FP8 72 PF*, TF32 18 PF* (sparse),
    # FP32 600 TF -> per GPU dense: 2,250 / 4,500 / 1,125 / 75 TFLOP/s.
    _row(
        "B200",
        r"\bB200\b",
        "NVIDIA HGX B200 datasheet, per GPU",
        fp32=75.0,
        tf32=1125.0,
        bf16=2250.0,
        fp16=2250.0,
        fp8=4500.0,
    ),
    # --- NVIDIA Hopper ------------------------------------------------------------------
    _row("H200 NVL", r"\bH200\b.*\bNVL\b", "NVIDIA H200 NVL datasheet", **_HOPPER_NVL),
    _row("H200", r"\bH200\b", "NVIDIA H200 datasheet", **_HOPPER_SXM),
    _row("H100 NVL", r"\bH100\b.*\bNVL\b", "NVIDIA H100 NVL datasheet, per GPU", **_HOPPER_NVL),
    _row("H100 PCIe", r"\bH100\b.*\bPCIe\b", "NVIDIA H100 PCIe datasheet", **_HOPPER_PCIE),
    _row("H100 SXM", r"\bH100\b", "NVIDIA H100 datasheet", **_HOPPER_SXM),
    _row("H800 PCIe", r"\bH800\b.*\bPCIe\b", "NVIDIA H800 PCIe product brief", **_HOPPER_PCIE),
    _row("H800", r"\bH800\b", "NVIDIA H800 SXM5 product brief", **_HOPPER_SXM),
    # --- NVIDIA Ampere ------------------------------------------------------------------
    _row("A100", r"\bA100\b", "NVIDIA A100 datasheet", **_AMPERE_A100),
    _row("A800", r"\bA800\b", "NVIDIA A800 datasheet", **_AMPERE_A100),
    _row(
        "A10G",
        r"\bA10G\b",
        # AWS publishes no separate tensor peak for its A10G; Lightning's throughput.py and
        # Composer use the A10 datasheet figures for it, and so do we, saying so.
        "NVIDIA A10 datasheet (for A10G)",
        fp32=31.2,
        tf32=62.5,
        bf16=125.0,
        fp16=125.0,
    ),
    _row("A10", r"\bA10\b", "NVIDIA A10 datasheet", fp32=31.2, tf32=62.5, bf16=125.0, fp16=125.0),
    # --- NVIDIA Ada ---------------------------------------------------------------------
    # L40S datasheet prints both columns: BF16 362.05 | 733*, FP8 733 | 1,466*, TF32 183 | 366*.
    _row(
        "L40S",
        r"\bL40S\b",
        "NVIDIA L40S datasheet",
        fp32=91.6,
        tf32=183.0,
        bf16=362.05,
        fp16=362.05,
        fp8=733.0,
    ),
    # L4 datasheet: BF16 242*, FP8 485*, TF32 120* (sparse); FP32 30.3.
    _row(
        "L4",
        r"\bL4\b",
        "NVIDIA L4 datasheet",
        fp32=30.3,
        tf32=60.0,
        bf16=121.0,
        fp16=121.0,
        fp8=242.5,
    ),
    # --- NVIDIA Volta (no BF16 tensor cores: a bf16 run gets no peak) ---------------------
    _row("V100S PCIe", r"\bV100S\b", "NVIDIA V100S datasheet", fp64=8.2, fp32=16.4, fp16=130.0),
    _row("V100 PCIe", r"\bV100\b.*\bPCIe\b", "NVIDIA V100 datasheet", fp64=7.0, fp32=14.0, fp16=112.0),
    _row("V100 SXM2", r"\bV100\b", "NVIDIA V100 datasheet", fp64=7.8, fp32=15.7, fp16=125.0),
    # --- AMD Instinct -------------------------------------------------------------------
    # MI300X datasheet: BF16/FP16 1,307.4 dense (2,614.9 with sparsity), FP8 2,614.9, TF32 653.7,
    # FP32/FP64 matrix 163.4. MI325X has the same compute. (MI300A is a different part.)
    _row(
        "MI300X",
        r"\bMI3(00|25)X\b",
        "AMD Instinct MI300X datasheet",
        fp64=163.4,
        fp32=163.4,
        tf32=653.7,
        bf16=1307.4,
        fp16=1307.4,
        fp8=2614.9,
    ),
    # MI250X datasheet (one OAM module = 2 GCDs): BF16/FP16 383, FP32/FP64 matrix 95.7.
    # Each GCD is its own torch device, so one device gets half.
    _row(
        "MI250X",
        r"\bMI250X?\b",
        "AMD Instinct MI250X datasheet, per GCD",
        fp64=47.85,
        fp32=47.85,
        bf16=191.5,
        fp16=191.5,
    ),
    # --- Google TPU (device names as reported by torch_xla, e.g. "TPU v4") ---------------
    # Cloud TPU system-architecture pages, bf16 peak per chip (v4: 275, as used by PaLM).
    _row("TPU v4", r"\bTPU\s*v4\b", "Google Cloud TPU v4 docs", bf16=275.0),
    _row("TPU v5p", r"\bTPU\s*v5p\b", "Google Cloud TPU v5p docs", bf16=459.0),
    _row("TPU v5e", r"\bTPU\s*v5(e|\s*lite)\b", "Google Cloud TPU v5e docs", bf16=197.0),
    _row("TPU v6e", r"\bTPU\s*v6(e|\s*lite)\b", "Google Cloud TPU v6e docs", bf16=918.0),
)


def find_row(device_name: str) -> PeakRow | None:
    """The first table row whose pattern matches ``device_name``, or ``None``."""
    for row in PEAKS:
        if row.pattern.search(device_name):
            return row
    return None


class UnknownPeakWarning(UserWarning):
    """No dense peak is known for this device and dtype: MFU will be null."""


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


def warn_unknown_peak(device_name: str, dtype: str) -> None:
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
