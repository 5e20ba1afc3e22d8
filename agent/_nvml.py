"""GPU telemetry from NVML, sampled once per profiler window (optional).

``nvidia-ml-py`` (import name ``pynvml``) is optional: without it, or without a GPU, or
when any NVML call fails, :meth:`Nvml.sample` returns ``None`` and the collector stores
nulls. The device is found by its UUID (robust to ``CUDA_VISIBLE_DEVICES`` reordering),
else by index. Field names follow dcgm-exporter's vocabulary where it has one (UUID),
so a rank's window can be joined with that GPU's DCGM series.

Runs on the agent's profiler thread only.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

log = logging.getLogger("stepwatch")

#: NVML ``nvmlClocksEventReason*`` / ``nvmlClocksThrottleReason*`` bits, in bit order.
THROTTLE_REASONS: tuple[tuple[int, str], ...] = (
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
)


def throttle_names(mask: int) -> list[str]:
    """Names of the set bits of an NVML clock-event (throttle) reason mask."""
    return [name for bit, name in THROTTLE_REASONS if mask & bit]


def _text(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class Nvml:
    """One GPU's handle, resolved lazily; every failure ends in ``None``, never raises."""

    def __init__(self, *, uuid: str | None = None, index: int | None = None) -> None:
        self._uuid = uuid
        self._index = index
        self._lib: Any = None
        self._handle: Any = None
        self._failed = False

    def _open(self) -> bool:
        if self._handle is not None:
            return True
        if self._failed or (self._uuid is None and self._index is None):
            return False
        try:
            lib = importlib.import_module("pynvml")
            lib.nvmlInit()
            if self._uuid is not None:
                uuid = self._uuid if self._uuid.startswith(("GPU-", "MIG-")) else f"GPU-{self._uuid}"
                self._handle = lib.nvmlDeviceGetHandleByUUID(uuid)
            else:
                self._handle = lib.nvmlDeviceGetHandleByIndex(self._index)
            self._lib = lib
            return True
        except Exception as exc:  # no module, no driver, no such device
            self._failed = True
            log.debug("stepwatch: NVML unavailable: %r", exc)
            return False

    def sample(self) -> dict[str, Any] | None:
        """UUID, SM clock (MHz), power (W), temperature (°C) and throttle reasons, or None."""
        if not self._open():
            return None
        lib, h = self._lib, self._handle
        out: dict[str, Any] = {
            "gpu_uuid": None,
            "sm_clock_mhz": None,
            "power_w": None,
            "temperature_c": None,
            "throttle_reasons": None,
        }
        calls: dict[str, Any] = {
            "gpu_uuid": lambda: _text(lib.nvmlDeviceGetUUID(h))[:64],
            "sm_clock_mhz": lambda: float(lib.nvmlDeviceGetClockInfo(h, lib.NVML_CLOCK_SM)),
            "power_w": lambda: lib.nvmlDeviceGetPowerUsage(h) / 1000.0,
            "temperature_c": lambda: float(lib.nvmlDeviceGetTemperature(h, lib.NVML_TEMPERATURE_GPU)),
            "throttle_reasons": lambda: throttle_names(int(_reasons(lib, h))),
        }
        for name, call in calls.items():
            try:
                out[name] = call()
            except Exception as exc:  # one unsupported query must not hide the others
                log.debug("stepwatch: NVML %s: %r", name, exc)
        return out


def _reasons(lib: Any, handle: Any) -> int:
    fn = (
        getattr(lib, "nvmlDeviceGetCurrentClocksEventReasons", None)
        or lib.nvmlDeviceGetCurrentClocksThrottleReasons
    )
    return int(fn(handle))


def for_current_cuda_device() -> Nvml:
    """The NVML view of the CUDA device this process uses (torch's current device)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return Nvml()
        index = torch.cuda.current_device()
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        return Nvml(uuid=str(uuid) if uuid is not None else None, index=index)
    except Exception:
        return Nvml()
