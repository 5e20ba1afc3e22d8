"""What ``stepwatch.init`` prints, per rank, in a fresh process (the once-per-process
warnings make an in-process test depend on what ran before it)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from stepwatch.demo.launch import free_port

SCRIPT = """
import sys, torch, stepwatch
model = torch.nn.Linear(16, 16)  # on CPU: no peak in the table, so MFU is null
sw = stepwatch.init(run="msgs", model=model, url=sys.argv[1], rank=int(sys.argv[2]), world_size=4,
                    host="h", profile_every=0)
for _ in range(3):
    sw.step(tokens=1)
sw.close(timeout_s=0.0)
"""


def _stderr(rank: int, **env: str) -> str:
    url = f"http://127.0.0.1:{free_port()}"
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, url, str(rank)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


@pytest.mark.parametrize("rank", [0, 3])
def test_disabled_prints_nothing(rank: int) -> None:
    assert _stderr(rank, STEPWATCH_DISABLED="1") == ""


def test_the_unknown_peak_is_named_by_rank_0_alone_with_how_to_give_one() -> None:
    (line,) = [ln for ln in _stderr(0).splitlines() if "peak FLOP/s" in ln]
    assert "'cpu' at fp32" in line and "peak_flops=" in line and "measure one" in line, line
    assert "peak FLOP/s" not in _stderr(3)
