"""The MFU convention of a run and the one MFU formula.

An MFU figure is only comparable with another when both used the same FLOPs-per-token
formula, the same parameter count convention and the same peak, so no bare number is
handed out: :func:`stepwatch.flops.resolve_convention` fixes the choices once, at
``stepwatch.init``, into a frozen :class:`Convention` whose :attr:`Convention.id` (formula,
attention, dtype, device, peak and the source of that peak) travels with every payload and
is stored with the run.

Definition (DESIGN §3): ``MFU = model FLOPs/s achieved / (n_devices x dense peak FLOP/s of
one device at the dtype)``, a 0-1 ratio. Model FLOPs exclude activation recomputation;
hardware FLOPs (HFU) include it and are reported only when a recompute mode is given. An
unknown device gives MFU ``None``, never the peak of some other chip.

:func:`per_token_rate` is that formula as the factor that turns a job's tokens/s into MFU.
The collector stores conventions as dicts and multiplies its token rates (in Python and in
SQL) by this factor, so :meth:`Convention.mfu` and every MFU the collector serves are
one definition.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

from ._checks import choice, opt_positive_float, opt_positive_int, opt_str, positive_float

__all__ = ["ATTENTIONS", "FORMULAS", "RECOMPUTES", "Convention", "per_token_rate"]

FORMULAS: tuple[str, ...] = ("6N", "6N+12LHQT", "explicit", "measured")
ATTENTIONS: tuple[str, ...] = ("full", "causal")
RECOMPUTES: tuple[str, ...] = ("full", "selective")


def per_token_rate(
    convention: Mapping[str, object] | None, n_devices: int, flops_key: str = "flops_per_token"
) -> float | None:
    """MFU per token/s of the whole job: ``flops_per_token / (n_devices x peak_flops)``.

    With ``flops_key="hfu_flops_per_token"`` the HFU factor. ``None`` when the convention
    has no peak (an unknown device), no FLOPs for that key, or no devices. ``convention``
    is the wire form (:meth:`Convention.to_dict`, as the collector stores it).
    """
    conv = convention or {}
    flops, peak = conv.get(flops_key), conv.get("peak_flops")
    if not isinstance(flops, (int, float)) or not isinstance(peak, (int, float)) or not flops or not peak:
        return None
    if n_devices <= 0:
        return None
    return float(flops) / (n_devices * float(peak))


def _fmt_tflops(flops: float) -> str:
    return f"{round(flops / 1e12, 3):g}"


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
        choice("formula", self.formula, FORMULAS)
        choice("attention", self.attention, (None, *ATTENTIONS))
        choice("recompute", self.recompute, (None, *RECOMPUTES))
        positive_float("flops_per_token", self.flops_per_token)
        opt_positive_float("hfu_flops_per_token", self.hfu_flops_per_token)
        opt_positive_int("n_params", self.n_params)
        opt_positive_int("n_layers", self.n_layers)
        opt_positive_int("d_model", self.d_model)
        opt_positive_int("seq_len", self.seq_len)
        opt_positive_float("peak_flops", self.peak_flops)
        if not isinstance(self.embeddings_counted, bool):
            raise ValueError(f"embeddings_counted must be a bool, got {self.embeddings_counted!r}")
        if not isinstance(self.dtype, str) or not self.dtype:
            raise ValueError(f"dtype must be a non-empty string, got {self.dtype!r}")
        opt_str("device_name", self.device_name)
        opt_str("peak_source", self.peak_source)
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
            return positive_float(name, value)

        def integer(name: str) -> int | None:
            return opt_positive_int(name, d[name])

        def text(name: str) -> str | None:
            return opt_str(name, d[name])

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
        self.flops_per_device(tokens_per_s, n_devices)  # validates both arguments
        rate = per_token_rate(
            {"flops_per_token": self.flops_per_token, "peak_flops": self.peak_flops}, n_devices
        )
        return None if rate is None else tokens_per_s * rate

    def hfu(self, tokens_per_s: float, n_devices: int) -> float | None:
        """Hardware FLOPs utilisation (with recomputation), or ``None`` if unknown."""
        self.flops_per_device(tokens_per_s, n_devices)
        conv = {"hfu_flops_per_token": self.hfu_flops_per_token, "peak_flops": self.peak_flops}
        rate = per_token_rate(conv, n_devices, "hfu_flops_per_token")
        return None if rate is None else tokens_per_s * rate
