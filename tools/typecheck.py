"""Run mypy over agent/, server/ and dashboards/ under their import names.

The build maps folders to import names (agent/ -> stepwatch, server/ -> stepwatch_server,
migrations/ -> stepwatch_server.migrations). mypy cannot see setuptools' editable-install
finder, so this script lays out a tree of symbolic links with the import names and points
mypy at it. Exit status is mypy's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "typecheck"


def _link_children(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for child in src.iterdir():
        if child.name == "__pycache__":
            continue
        os.symlink(child, dst / child.name)


def main() -> int:
    shutil.rmtree(TREE, ignore_errors=True)
    TREE.mkdir(parents=True)
    os.symlink(ROOT / "agent", TREE / "stepwatch")
    _link_children(ROOT / "server", TREE / "stepwatch_server")
    os.symlink(ROOT / "migrations", TREE / "stepwatch_server" / "migrations")
    os.symlink(ROOT / "dashboards", TREE / "dashboards")
    cmd = [
        sys.executable,
        "-m",
        "mypy",
        "--config-file",
        str(ROOT / "pyproject.toml"),
        "-p",
        "stepwatch",
        "-p",
        "stepwatch_server",
        "-p",
        "dashboards",
    ]
    env = dict(os.environ, MYPYPATH=str(TREE))
    return subprocess.call(cmd, cwd=TREE, env=env)


if __name__ == "__main__":
    raise SystemExit(main())
