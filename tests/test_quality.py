"""Lint, format and type checks run as part of the test command, so CI enforces them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

import stepwatch

ROOT = Path(__file__).resolve().parents[1]


def _run(*cmd: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)


def test_ruff_lint() -> None:
    r = _run(sys.executable, "-m", "ruff", "check", ".")
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_format() -> None:
    r = _run(sys.executable, "-m", "ruff", "format", "--check", ".")
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_strict_on_agent_and_server() -> None:
    # Without a cache (a fresh clone) and beside three other workers on 2 loaded cores,
    # mypy ran past 300 s (2026-12-05); the bound is a hang guard, not a speed check.
    r = _run(sys.executable, "tools/typecheck.py", timeout_s=1200)
    assert r.returncode == 0, r.stdout + r.stderr


def test_public_surface_is_sorted_and_complete() -> None:
    assert stepwatch.__all__ == sorted(stepwatch.__all__)
    public = {
        name
        for name in dir(stepwatch)
        if not name.startswith("_")
        and not isinstance(getattr(stepwatch, name), ModuleType)
        and name != "annotations"
    }
    assert public == set(stepwatch.__all__) - {"__version__"}
