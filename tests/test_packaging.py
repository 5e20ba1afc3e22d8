"""Both install modes import the mapped folders correctly (agent/ -> stepwatch,
server/ -> stepwatch_server, migrations/ -> stepwatch_server.migrations)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_editable_install_maps_folders_to_import_names() -> None:
    import stepwatch
    import stepwatch_server
    import stepwatch_server.migrations

    assert Path(stepwatch.__file__).parent == ROOT / "agent"
    assert Path(stepwatch_server.__file__).parent == ROOT / "server"
    assert Path(stepwatch_server.migrations.__file__).parent == ROOT / "migrations"


def test_built_wheel_carries_everything_and_works(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("stepwatch-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    # Every source and data file of the three mapped folders is in the wheel under its import name.
    mapping = {
        "agent": "stepwatch",
        "server": "stepwatch_server",
        "migrations": "stepwatch_server/migrations",
    }
    expected = {
        f"{target}/{path.relative_to(ROOT / folder).as_posix()}"
        for folder, target in mapping.items()
        for path in (ROOT / folder).rglob("*")
        if (
            path.suffix in (".py", ".mako", ".typed", ".html", ".js", ".css") or path.name.endswith("LICENSE")
        )
        and "__pycache__" not in path.parts
    }
    # The web page's templates and vendored chart library (with its license) are data files.
    assert {
        "stepwatch_server/web/static/uPlot.iife.min.js",
        "stepwatch_server/web/static/uPlot.LICENSE",
    } <= expected
    missing = sorted(expected - names)
    assert not missing, f"missing from {wheel.name}: {missing}"
    metadata = next(n for n in names if n.endswith("METADATA"))
    meta = zipfile.ZipFile(wheel).read(metadata).decode()
    torch_reqs = [line for line in meta.splitlines() if line.startswith("Requires-Dist: torch")]
    assert torch_reqs and all(
        "==" not in (spec := r.split(";")[0]) and "<" in spec and ">=" in spec for r in torch_reqs
    ), torch_reqs
    assert not any(
        line.startswith("Requires-Dist: torch") and "extra" not in line for line in meta.splitlines()
    )

    # Install the wheel alone into a target folder and run its migrations from there,
    # in a process where the editable install is not on the path.
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    code = (
        "import sys, stepwatch, stepwatch_server.migrations as m;"
        f"assert stepwatch.__file__.startswith({str(target)!r}), stepwatch.__file__;"
        f"assert m.__file__.startswith({str(target)!r}), m.__file__;"
        "from stepwatch.cli import main;"
        f"sys.exit(main(['db', 'upgrade', '--database-url', 'sqlite:///{tmp_path}/w.db']))"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path
    )
    assert r.returncode == 0, r.stdout + r.stderr
    from stepwatch_server.storage.migrate import head_revision

    assert f"database at {head_revision()}" in r.stdout


def test_readme_opens_with_install_naming_every_extra() -> None:
    import tomllib

    readme = (ROOT / "README.md").read_text()
    sections = [line for line in readme.splitlines() if line.startswith("## ")]
    assert sections[0] == "## Install", sections[:3]
    install = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    assert "pip install stepwatch " in install and "pip install 'stepwatch[server]'" in install
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    rows = {line.split("|")[1].strip().strip("`") for line in install.splitlines() if line.startswith("| `")}
    assert rows == set(extras), "each extra is in the Install table, and nothing else"
