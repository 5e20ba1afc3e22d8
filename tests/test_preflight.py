"""tools/preflight: `make test` on a fresh machine installs what the tests need or says,
in one line, what to install. Checked against a PATH that lacks some of the commands (and
apt-get, so that nothing is installed here)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PREFLIGHT = Path(__file__).resolve().parent.parent / "tools" / "preflight"
ALL = (
    "bash",
    "timeout",
    "id",
    "promtool",
    "amtool",
    "docker-compose",
    "chromium",
    "chromedriver",
    "srun",
    "slurmctld",
    "slurmd",
    "munged",
)


def _path_with(tmp_path: Path, commands: tuple[str, ...]) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in commands:
        found = shutil.which(name)
        assert found, f"{name} is not installed here: run `make test`, whose preflight installs it"
        (bin_dir / name).symlink_to(found)
    return str(bin_dir)


def _run(tmp_path: Path, missing: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    path = _path_with(tmp_path, tuple(c for c in ALL if c not in missing))
    python = os.path.realpath(sys.executable)  # the interpreter behind this venv
    env = {k: v for k, v in os.environ.items() if k not in ("STEPWATCH_NO_INSTALL",)}
    return subprocess.run(
        [str(PREFLIGHT)],
        env={**env, "PATH": path, "PYTHON": python},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_everything_present_is_silent(tmp_path: Path) -> None:
    proc = _run(tmp_path, missing=())
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")


@pytest.mark.parametrize(
    ("missing", "packages"),
    [
        (("promtool",), "prometheus"),
        (
            ("promtool", "amtool", "chromium", "chromedriver"),
            "prometheus prometheus-alertmanager chromium chromium-driver",
        ),
        (("srun", "slurmctld", "slurmd", "munged"), "slurm-client slurmctld slurmd munge"),
    ],
)
def test_what_is_missing_is_named_in_one_line(
    tmp_path: Path, missing: tuple[str, ...], packages: str
) -> None:
    proc = _run(tmp_path, missing)
    assert proc.returncode == 1 and proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert f"apt-get install -y {packages} (as root)" in line, line


def test_ci_runs_the_readme_test_command_and_nothing_else() -> None:
    root = PREFLIGHT.parent.parent
    commands = [
        ln.strip()
        for ln in (root / ".ci" / "run").read_text().splitlines()
        if ln.strip() and not ln.lstrip().startswith("#")
    ]
    assert commands[-1] == "exec make test" and not any("apt-get" in c for c in commands)
    assert "make test" in (root / "README.md").read_text()
    assert "test: preflight venv" in (root / "Makefile").read_text().splitlines()
