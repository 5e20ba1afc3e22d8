"""Per-connection link timing from the kernel (``TCP_INFO``), sampled on the sender thread.

Why: a slowed link does not show in one rank's collective timing. A ring all-reduce
moves at the pace of its slowest link, so every rank of the group sees the same longer
transfer and the same arrivals (measured on real gloo ranks in network namespaces, one
veth limited by ``tc tbf``: the per-rank sync, arrival and duration differed by a few
milliseconds, in an order set by the ring, not by the slow rank). What differs is the
links themselves: the kernel keeps, per TCP connection, the bytes the peer acknowledged
and the time the connection was busy with data in flight (``tcpi_busy_time``, minus the
time the receiver's window was the limit: a slow reader is its host's problem, not the
link's). Bytes over busy time is the rate the link delivered while it had work. A rank
whose link is slow has *every* connection that carries its data slow, in and out; its
peers have one slow connection each (the one to it). The collector intersects them
(``stepwatch_server.analysis.links``). The bytes also tell a rank that moved more data
than its peers (extra communication on its link).

Cost: once per window on the sender thread, one ``readlink`` per open descriptor and one
``getsockopt`` per TCP connection; nothing on the training thread. Scope: TCP transports
(gloo, and NCCL's socket transport); InfiniBand/RoCE and NVLink need the NIC's counters
and are not covered (README). Linux only; elsewhere, or where ``TCP_INFO`` is older than
the fields read (Linux < 4.10), :meth:`LinkSampler.sample` returns nothing.

Endpoints are sent as 63-bit hashes of ``address:port`` (both ends of a connection
compute the same two), so the collector can join the two ends without storing
addresses.
"""

from __future__ import annotations

import hashlib
import os
import socket
import struct
from collections.abc import Callable, Iterable
from typing import Any

from .wire import MAX_LINKS

#: Connections that moved less than this in a window (in both directions) are left out:
#: the TCP store, the agent's own HTTP, idle peers.
MIN_BYTES = 64 * 1024
_TCP_INFO_LEN = 192  # through tcpi_sndbuf_limited
_OFF_BYTES_ACKED = 120
_OFF_BYTES_RECEIVED = 128
_OFF_BUSY = 168  # busy_time, rwnd_limited, sndbuf_limited: microseconds


def endpoint_id(host: str, port: int) -> int:
    """A 63-bit id of ``host:port`` (both ends of a connection compute the same)."""
    digest = hashlib.blake2b(f"{host}:{port}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def parse_tcp_info(raw: bytes) -> tuple[int, int, float] | None:
    """(bytes acknowledged by the peer, bytes received, busy seconds not limited by the
    receiver's window) from a ``TCP_INFO`` buffer, or None if it is too short."""
    if len(raw) < _TCP_INFO_LEN:
        return None
    (acked,) = struct.unpack_from("Q", raw, _OFF_BYTES_ACKED)
    (received,) = struct.unpack_from("Q", raw, _OFF_BYTES_RECEIVED)
    busy, rwnd, _sndbuf = struct.unpack_from("QQQ", raw, _OFF_BUSY)
    return acked, received, max(0, busy - rwnd) / 1e6


def _process_sockets() -> Iterable[tuple[tuple[str, int], tuple[str, int], bytes]]:
    """(local, peer, TCP_INFO) of this process's connected TCP sockets."""
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return
    for name in fds:
        try:
            fd = int(name)
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM)  # a duplicate
        except (OSError, ValueError):
            continue
        try:
            if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            raw = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
            local, peer = s.getsockname(), s.getpeername()
        except OSError:  # not TCP, not connected, or closed meanwhile
            continue
        finally:
            s.close()  # closes the duplicate only
        yield (str(local[0]), int(local[1])), (str(peer[0]), int(peer[1])), raw


class LinkSampler:
    """Per-window deltas of the process's TCP connections (see the module docstring).

    ``exclude_ports``: peer ports never reported (the collector's: its host name may
    resolve to any address, and resolving it here could block). Called from the sender
    thread only; never raises.
    """

    def __init__(
        self,
        exclude_ports: Iterable[int] = (),
        sockets: Callable[[], Iterable[tuple[tuple[str, int], tuple[str, int], bytes]]] = _process_sockets,
    ) -> None:
        self._exclude = frozenset(exclude_ports)
        self._sockets = sockets
        self._prev: dict[tuple[int, int], tuple[int, int, float]] = {}
        self._baseline = False
        self.enabled = hasattr(socket, "TCP_INFO")

    def sample(self) -> list[dict[str, Any]]:
        """Connections that moved at least ``MIN_BYTES`` since the last call: ``local``
        and ``peer`` endpoint ids, ``bytes`` sent (acknowledged), ``received``, and
        ``busy_s``. The first call only sets the baseline."""
        if not self.enabled:
            return []
        try:
            return self._sample()
        except Exception:  # a timing failure only loses the timing
            return []

    def _sample(self) -> list[dict[str, Any]]:
        now: dict[tuple[int, int], tuple[int, int, float]] = {}
        first, self._baseline = not self._baseline, True
        out = []
        for local, peer, raw in self._sockets():
            if peer[1] in self._exclude:
                continue
            info = parse_tcp_info(raw)
            if info is None:
                continue
            key = (endpoint_id(*local), endpoint_id(*peer))
            now[key] = info
            prev = self._prev.get(key, (0, 0, 0.0))
            sent, received, busy = info[0] - prev[0], info[1] - prev[1], info[2] - prev[2]
            if first or sent < 0 or received < 0 or sent + received < MIN_BYTES:
                continue
            out.append(
                {
                    "local": key[0],
                    "peer": key[1],
                    "bytes": sent,
                    "received": received,
                    "busy_s": round(busy, 6),
                }
            )
        self._prev = now
        out.sort(key=lambda x: -(x["bytes"] + x["received"]))
        return out[:MAX_LINKS]
