"""The demo's and the tests' process launcher: ports for servers about to bind."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from stepwatch.demo import launch


def test_a_free_port_lies_below_the_range_outgoing_connections_take_ports_from() -> None:
    """A port from ``bind(0)`` can be taken by any process's ``connect`` before the server
    binds it; one below the ephemeral range only by another ``bind``."""
    low = launch._ephemeral_low()
    ports = [launch.free_port() for _ in range(50)]
    assert all(max(1024, low - launch.PORT_SPAN) <= p < low for p in ports), ports
    assert len(set(ports)) > 40, "picked at random, not one fixed port for every caller"
    for p in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_in_use_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        other = launch.free_port()
        picks: Iterator[int] = iter([taken, taken, other])

        class Picks:
            def randrange(self, _lo: int, _hi: int) -> int:
                return next(picks)

        monkeypatch.setattr(launch.random, "SystemRandom", Picks)
        assert launch.free_port() == other


def test_with_no_room_below_the_range_the_kernel_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    """An ephemeral range that starts at 1024 (a common tuning) leaves nothing below."""
    monkeypatch.setattr(launch, "_ephemeral_low", lambda: 1024)
    port = launch.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
