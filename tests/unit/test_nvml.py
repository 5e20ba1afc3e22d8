"""NVML sampling. There is no GPU and no NVML driver on this machine, so a fake ``pynvml``
module (the real package's function names and constants) stands in for the library;
the real thing can only run on a GPU host."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from stepwatch._nvml import Nvml, throttle_names


def _fake_pynvml(fail: set[str] | None = None) -> types.ModuleType:
    fail = fail or set()
    m = types.ModuleType("pynvml")
    calls: dict[str, Any] = {}

    def maybe(name: str, value: Any) -> Any:
        calls[name] = calls.get(name, 0) + 1
        if name in fail:
            raise RuntimeError(f"NVML_ERROR_NOT_SUPPORTED in {name}")
        return value

    m.NVML_CLOCK_SM = 1  # type: ignore[attr-defined]
    m.NVML_TEMPERATURE_GPU = 0  # type: ignore[attr-defined]
    m.nvmlInit = lambda: maybe("nvmlInit", None)  # type: ignore[attr-defined]
    m.nvmlDeviceGetHandleByUUID = lambda uuid: maybe("byuuid", ("h", uuid))  # type: ignore[attr-defined]
    m.nvmlDeviceGetHandleByIndex = lambda i: maybe("byindex", ("h", i))  # type: ignore[attr-defined]
    m.nvmlDeviceGetUUID = lambda h: maybe("uuid", b"GPU-1a2b3c4d-0000-1111-2222-333344445555")  # type: ignore[attr-defined]
    m.nvmlDeviceGetClockInfo = lambda h, kind: maybe("clock", 1755 if kind == 1 else 0)  # type: ignore[attr-defined]
    m.nvmlDeviceGetPowerUsage = lambda h: maybe("power", 612_500)  # milliwatts  # type: ignore[attr-defined]
    m.nvmlDeviceGetTemperature = lambda h, kind: maybe("temp", 71)  # type: ignore[attr-defined]
    m.nvmlDeviceGetCurrentClocksThrottleReasons = lambda h: maybe("throttle", 0x4 | 0x40)  # type: ignore[attr-defined]
    m.calls = calls  # type: ignore[attr-defined]
    return m


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    m = _fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", m)
    return m


def test_sample_reads_every_field_in_base_units(fake: types.ModuleType) -> None:
    nv = Nvml(uuid="1a2b3c4d-0000-1111-2222-333344445555", index=3)
    s = nv.sample()
    assert s == {
        "gpu_uuid": "GPU-1a2b3c4d-0000-1111-2222-333344445555",
        "sm_clock_mhz": 1755.0,
        "power_w": 612.5,
        "temperature_c": 71.0,
        "throttle_reasons": ["sw_power_cap", "hw_thermal_slowdown"],
    }
    # Found by UUID (with NVML's "GPU-" prefix added), not by index; initialised once.
    nv.sample()
    assert fake.calls["byuuid"] == 1 and "byindex" not in fake.calls and fake.calls["nvmlInit"] == 1  # type: ignore[attr-defined]


def test_one_unsupported_query_leaves_only_that_field_null(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(fail={"power"}))
    s = Nvml(index=0).sample()
    assert s is not None and s["power_w"] is None and s["sm_clock_mhz"] == 1755.0


def test_without_nvml_or_device_everything_is_null(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    assert Nvml(index=0).sample() is None
    assert Nvml().sample() is None
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(fail={"nvmlInit"}))
    assert Nvml(index=0).sample() is None


def test_throttle_names() -> None:
    assert throttle_names(0) == []
    assert throttle_names(0x1 | 0x8 | 0x100) == ["gpu_idle", "hw_slowdown", "display_clock_setting"]
