"""Every command answers ``--help`` with what it does, and bad values are refused with
a message that names them."""

from __future__ import annotations

import pytest

from stepwatch.cli import main

COMMANDS = {
    (): "New here? Run `stepwatch demo`",
    ("serve",): "Run the collector",
    ("db",): "Database maintenance",
    ("db", "upgrade"): "Apply the collector's database migrations",
    ("demo",): "slow one rank down mid-run",
    ("top",): "Live terminal view of a collector",
}


@pytest.mark.parametrize("command", list(COMMANDS), ids=lambda c: " ".join(c) or "stepwatch")
def test_help_of_every_command(command: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith(f"usage: stepwatch {' '.join(command)}".rstrip())
    assert COMMANDS[command] in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--steps", "0"], "argument --steps: must be at least 1, got 0"),
        (["top", "--interval", "-1"], "argument --interval: must be > 0, got -1.0"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_bad_arguments_are_named(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
