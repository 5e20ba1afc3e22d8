"""The agent's link sampler (``stepwatch._links``) on real TCP connections over loopback:
the kernel's TCP_INFO gives each end's bytes and busy time, the two ends' endpoint ids
match crosswise, the first call is a baseline, the collector's port is left out."""

from __future__ import annotations

import socket
import threading

from stepwatch import wire
from stepwatch._links import MIN_BYTES, LinkSampler, endpoint_id, parse_tcp_info

PAYLOAD = 4 * MIN_BYTES


def _pair() -> tuple[socket.socket, socket.socket, socket.socket]:
    srv = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(srv.getsockname())
    b, _ = srv.accept()
    return srv, a, b


def _send(a: socket.socket, b: socket.socket, n: int) -> None:
    got = bytearray()
    t = threading.Thread(target=lambda: got.extend(_recv_all(b, n)))
    t.start()
    a.sendall(b"x" * n)
    t.join(10)
    assert len(got) == n


def _recv_all(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


def test_endpoint_ids_are_stable_and_fit_the_column() -> None:
    assert endpoint_id("10.0.0.1", 80) == endpoint_id("10.0.0.1", 80) != endpoint_id("10.0.0.1", 81)
    assert 0 <= endpoint_id("::1", 65535) < wire.ENDPOINT_ID_BOUND


def test_parse_refuses_a_short_buffer() -> None:
    assert parse_tcp_info(b"\0" * 100) is None


def test_a_connection_is_seen_from_both_ends_with_its_bytes() -> None:
    srv, a, b = _pair()
    try:
        sampler = LinkSampler()
        assert sampler.sample() == []  # the baseline
        _send(a, b, PAYLOAD)
        got = sampler.sample()
        la, lb = a.getsockname(), b.getsockname()
        ida, idb = endpoint_id(*la), endpoint_id(*lb)
        ends = {(x["local"], x["peer"]): x for x in got}
        sender, receiver = ends[(ida, idb)], ends[(idb, ida)]
        assert sender["bytes"] >= PAYLOAD and sender["received"] < MIN_BYTES
        assert receiver["received"] >= PAYLOAD
        assert sender["busy_s"] >= 0.0
        # Deltas: nothing moved since, so nothing is reported.
        assert [x for x in sampler.sample() if (x["local"], x["peer"]) in ends] == []
    finally:
        for s in (a, b, srv):
            s.close()


def test_the_collectors_port_is_left_out() -> None:
    srv, a, b = _pair()
    try:
        sampler = LinkSampler(exclude_ports=[srv.getsockname()[1]])
        sampler.sample()
        _send(a, b, PAYLOAD)
        ida = endpoint_id(*a.getsockname())
        locals_ = {x["local"] for x in sampler.sample()}
        assert ida not in locals_  # a's peer is the excluded port
        assert endpoint_id(*b.getsockname()) in locals_  # b's peer is a's ephemeral port
    finally:
        for s in (a, b, srv):
            s.close()
