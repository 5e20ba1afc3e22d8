"""Both install modes import the mapped folders correctly (agent/ -> stepwatch,
server/ -> stepwatch_server, migrations/ -> stepwatch_server.migrations), and the agent
alone (a wheel installed without extras into a fresh venv) is what a training job gets:
a light ``import stepwatch`` and one-line answers from the commands it cannot run."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: What `import stepwatch` must not pull into a training process.
HEAVY = (
    "stepwatch_server",
    "stepwatch.demo",
    "stepwatch.simulate",
    "stepwatch.views",
    "rich",
    "numpy",
    "httpx",
)
DEMO_HINT = "pip install 'stepwatch[demo]'"
LIGHT_CHECK = (
    "import sys, stepwatch; heavy = {heavy!r};"
    "bad = sorted(m for m in sys.modules if any(m == h or m.startswith(h + '.') for h in heavy));"
    "assert not bad, bad; print('light')"
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    # What the build printed, for the test that the configuration draws no warnings.
    (out / "build.log").write_text(built.stdout + built.stderr)
    (whl,) = out.glob("stepwatch-*.whl")
    return whl


def test_the_build_draws_no_setuptools_warning(wheel: Path) -> None:
    """A deprecated ``license`` table or a data folder missing from ``packages`` makes
    setuptools print a long block at every install, which buries what the user needs."""
    log = (wheel.parent / "build.log").read_text()
    assert "Warning" not in log, log


def test_import_stepwatch_stays_light_with_everything_installed() -> None:
    # The development venv has every extra installed: importing the agent still loads none of them.
    r = subprocess.run(
        [sys.executable, "-c", LIGHT_CHECK.format(heavy=HEAVY)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and r.stdout.strip() == "light", r.stdout + r.stderr


def test_wheel_without_extras_runs_the_agent_and_names_the_missing_extra(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=120)
    pip = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert pip.returncode == 0, pip.stderr
    python, cli = str(venv / "bin" / "python"), str(venv / "bin" / "stepwatch")
    light = subprocess.run(
        [python, "-c", LIGHT_CHECK.format(heavy=HEAVY)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert light.returncode == 0 and light.stdout.strip() == "light", light.stdout + light.stderr
    for argv, line in [
        (["serve"], "`stepwatch serve` needs the collector: pip install 'stepwatch[server]'"),
        (["db", "upgrade"], "`stepwatch db` needs the collector: pip install 'stepwatch[server]'"),
        (["evaluate", "--fast"], "`stepwatch evaluate` needs the collector: pip install 'stepwatch[server]'"),
        (["top"], "`stepwatch top` needs the terminal views: pip install 'stepwatch[top]'"),
        (["demo"], "`stepwatch demo` needs the demo (a collector and a torch training): " + DEMO_HINT),
    ]:
        r = subprocess.run([cli, *argv], capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert (r.returncode, r.stdout, r.stderr) == (2, "", line + "\n"), (argv, r.stdout, r.stderr)
    helped = subprocess.run([cli, "--help"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert helped.returncode == 0
    listing = " ".join(helped.stdout.split())  # argparse wraps the help column
    # Each command's line of the listing says which extra it waits for; simulate's says nothing.
    commands = ["serve", "db", "demo", "top", "simulate", "evaluate"]
    lines = {
        c: listing.split(f" {c} ", 1)[1].split(f" {commands[i + 1]} ", 1)[0] if i + 1 < len(commands) else ""
        for i, c in enumerate(commands)
    }
    lines["evaluate"] = listing.split(" evaluate ", 1)[1]
    for command, extra in [
        ("serve", "server"),
        ("db", "server"),
        ("demo", "demo"),
        ("top", "top"),
        ("evaluate", "server"),
    ]:
        assert f"[needs pip install 'stepwatch[{extra}]']" in lines[command], (command, lines[command])
    assert "needs" not in lines["simulate"], lines["simulate"]
    # The simulator needs the agent only.
    sim = subprocess.run(
        [cli, "simulate", "--help"], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert sim.returncode == 0 and "--fault" in sim.stdout, sim.stderr


def test_editable_install_maps_folders_to_import_names() -> None:
    import stepwatch
    import stepwatch_server
    import stepwatch_server.migrations

    assert Path(stepwatch.__file__).parent == ROOT / "agent"
    assert Path(stepwatch_server.__file__).parent == ROOT / "server"
    assert Path(stepwatch_server.migrations.__file__).parent == ROOT / "migrations"


def test_built_wheel_carries_everything_and_works(wheel: Path, tmp_path: Path) -> None:
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
    # The license as an SPDX expression (PEP 639): the TOML-table form made every
    # `pip install -e .` print a long setuptools deprecation block.
    assert "License-Expression: Apache-2.0" in meta.splitlines(), meta[:600]

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
