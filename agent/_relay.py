"""Per-host batching: the windows of every rank of a host in one POST.

At thousands of ranks, one POST per rank and window is most of the collector's cost (each
request pays HTTP, the bearer check and a turn of the event loop) and one connection per
rank. With host batching on (the default where the launcher says the host runs several
ranks of the job, ``_env.local_world_size``; ``STEPWATCH_HOST_BATCH``,
``init(host_batch=...)``), a rank's sender hands each window over a Unix socket to the
host's relay: a thread in whichever of the host's processes bound the socket first. The
relay posts the windows it holds to ``wire.HOST_BATCH_PATH`` together, as soon as each of
the host's ranks has one waiting (the launcher's count, or the ranks connected;
synchronous training closes them within a step of each other) or :data:`LINGER_S` after
the first, and hands each rank its own entry's answer.

A rank's sender still owns its window: its buffer, retries, give-ups and the directives
it is answered stay per rank, as without the relay; only the request is shared. So the
guarantees are the same: an entry is acknowledged only by the collector's answer to it,
and a retried entry is stored once (its ``batch_id``). When the collector is away or
busy, every rank is told so and retries as it would have. When it refuses the host batch
or fails on it (a 4xx: one bad entry, a token over its quota; a 5xx), or has no host-batch
route (an older collector; then for a minute), each rank posts its own entry alone, at
once and in parallel, and gets the answer it would have got by itself, so the good entries
are stored. A relay whose agent closes (its rank finished first) hands on: it closes the
socket and posts the entries that have reached it as one last host batch, so the ranks
that finish after it are not hung up on (one still on its way is, once, and its rank binds
the socket or posts alone). When the relay is gone (its process exited or was killed), the
next rank to find it gone binds the socket and relays from then on (a relay that hangs up
on a rank's entries in three posts in a row is given no more: the rank posts alone); a
rank that can neither reach a relay nor become one posts alone, and so for a minute does
one whose relay held its window without answering (a stopped or frozen process: the
heartbeats of a hang must still go).

The socket is in Linux's abstract namespace (no file to clean up after a SIGKILL), named
by the user, collector URL, token and job (``_env.job_identity``: torchrun's
``MASTER_ADDR:MASTER_PORT``, Slurm's job and step, the PMIx namespace, which every rank
of a job shares and two jobs on one node cannot), so only ranks of one job that would post to the same
collector with the same token share a request: a relay waits for its job's ranks on the
host, which another job's would not help it reach, and a job suspended while holding the
relay would hold up the other's windows. The abstract namespace is per network
namespace: ranks in a namespace (a container) each cannot meet, and each relays only its
own windows, 0.25 s late (``STEPWATCH_HOST_BATCH=0`` there). The abstract namespace has
no file permissions, so both ends check the other's user (``SO_PEERCRED``): the relay
refuses another user's connection, and a rank never hands its window (its token's data)
to a socket another user holds, it posts alone. Elsewhere than Linux, ranks post alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import selectors
import socket
import struct
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import _env, wire
from .retry import Verdict, retry_after_s, verdict

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("stepwatch")

#: Seconds the relay holds a host batch open for the ranks that have not sent theirs.
LINGER_S = 0.25
#: Seconds a rank posts alone after its relay took too long to answer.
ALONE_S = 60.0
#: Seconds a rank waits for a relay that another rank has bound but not yet made to
#: listen (it was four tries 0-30 ms apart; a binder descheduled longer made the rank
#: post alone).
START_RACE_S = 1.0
#: Posts in a row that a relay hangs up on (twice each) before the rank posts alone: a
#: relay that fails on every batch. One such post is usually a relaying rank that exited
#: while another's final window was on its way: retried, it goes through the next relay.
HUNG_UP_POSTS = 3
#: A host batch is posted once it holds this much: under the collector's default body
#: limit (2 MiB; a batch over the collector's limit is refused whole, then posted entry by
#: entry).
MAX_BATCH_BYTES = 1024 * 1024
#: No window is this large: a frame that says so is from a confused peer.
MAX_FRAME_BYTES = 64 * 1024 * 1024
_REQUEST = struct.Struct(">I")  # body length, then the body (one payload)
_ANSWER = struct.Struct(">HdI")  # status (0: no answer), Retry-After (NaN: none), length
#: Status of an answer the relay got no HTTP answer for (the content says why).
NO_ANSWER = 0
#: Status of an answer that tells the rank to post its entry itself: the collector refused
#: or failed on the host batch, or has no host-batch route (then the content is
#: :data:`NO_ROUTE`, and the rank posts alone for :data:`ALONE_S`).
ALONE = 1
NO_ROUTE = b"no host-batch route"


@dataclass(frozen=True)
class Answer:
    """The collector's answer to one rank's entry, as a lone POST would have got it."""

    status: int
    retry_after_s: float | None
    content: bytes


#: The relay's two answers "post it yourself": this entry, and (no route) for a while.
_ALONE = Answer(ALONE, None, b"")
_ALONE_NO_ROUTE = Answer(ALONE, None, NO_ROUTE)


def supported() -> bool:
    return sys.platform.startswith("linux")


def address(url: str, token: str | None) -> bytes:
    """The host's relay socket for this user, collector, token and job (abstract namespace)."""
    key = f"{os.getuid()}\n{url.rstrip('/')}\n{token or ''}\n{_env.job_identity()}".encode()
    return b"\0stepwatch-relay-" + hashlib.sha256(key).hexdigest()[:32].encode()


def _peer_uid(sock: socket.socket) -> int:
    # struct ucred: pid_t pid, uid_t uid, gid_t gid (uid and gid unsigned)
    _, uid, _ = struct.unpack("iII", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return int(uid)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(n)
        if not chunk:
            raise ConnectionError("the host's relay closed the connection")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


class RelayClient:
    """A rank's way to its host's relay (sender thread only)."""

    def __init__(self, url: str, token: str | None, headers: dict[str, str], timeout_s: float) -> None:
        self._url, self._headers, self._timeout_s = url, headers, timeout_s
        self._address = address(url, token)
        self._sock: socket.socket | None = None
        self._said: str | None = None
        self._alone_until = 0.0
        #: Posts in a row whose entry the relay took and hung up on, twice each.
        self._hung_up = 0

    def post(self, body: bytes, timeout_s: float) -> Answer | None:
        """The answer to ``body`` through the relay; None when the rank should post it
        alone (no relay can be had, the relay says so, or it hung up on the entry twice
        in each of HUNG_UP_POSTS posts in a row). Raises ``OSError`` when the relay did
        not answer in time or hung up twice (retry it)."""
        for _ in range(2):
            if time.monotonic() < self._alone_until:
                return None
            sock = self._connect()
            if sock is None:
                return None
            # The relay may first finish the host batch before this one: two of its
            # requests (each within its timeout), the linger, and a second to spare.
            sock.settimeout(2 * self._timeout_s + timeout_s + LINGER_S + 1.0)
            try:
                sock.sendall(_REQUEST.pack(len(body)) + body)
                status, retry_after, n = _ANSWER.unpack(_recv_exact(sock, _ANSWER.size))
                content = _recv_exact(sock, n)
            except TimeoutError:
                # A relay that holds the connection but does not answer (its process
                # stopped or frozen) would hold every rank of the host: post alone a while.
                self.close()
                self._alone_until = time.monotonic() + ALONE_S
                log.warning("stepwatch: the host's relay did not answer; posting alone for %g s", ALONE_S)
                raise
            except ConnectionError:
                # The relay's process exited (its rank finished first) or its thread
                # stopped: the next relay takes the entry (stored once: its batch_id).
                self.close()
                continue
            except OSError:
                self.close()
                raise
            if status == ALONE:
                if content == NO_ROUTE:  # an older collector: no use asking for a while
                    self._alone_until = time.monotonic() + ALONE_S
                    self._say("the collector has no host-batch route; posting alone")
                return None
            self._hung_up = 0
            return Answer(status, None if math.isnan(retry_after) else retry_after, content)
        # Hung up on twice: a relay whose process is exiting (its listener still open a
        # moment) or one that fails on every batch. The entry is retried (through the next
        # relay, once this one is gone); after HUNG_UP_POSTS such posts in a row the rank
        # posts alone instead of retrying through a failing relay for ever.
        self._hung_up += 1
        if self._hung_up >= HUNG_UP_POSTS:
            self._hung_up = 0
            return None
        raise ConnectionResetError("the host's relay hung up on this window twice")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _connect(self) -> socket.socket | None:
        if self._sock is not None:
            return self._sock
        # A rank that finds the address bound but not yet listening (another rank between
        # its bind and its listen) waits for it, up to START_RACE_S: a binder descheduled
        # for tens of milliseconds on a loaded host is no reason to post alone.
        deadline = time.monotonic() + START_RACE_S
        attempt = 0
        while attempt == 0 or time.monotonic() < deadline:
            attempt += 1
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(1.0)  # a relay whose backlog is full is no relay
            try:
                sock.connect(self._address)
                owner = _peer_uid(sock)
            except OSError:
                sock.close()
            else:
                if owner != os.getuid():  # never hand this rank's window to another user
                    sock.close()
                    self._alone_until = time.monotonic() + ALONE_S
                    log.warning("stepwatch: another user holds the host's relay socket; posting alone")
                    return None
                self._sock = sock
                self._say("batching this host's windows through its relay")
                return sock
            try:  # nobody relays: this process does from now on
                Relay.start(self._address, self._url, self._headers, self._timeout_s)
            except OSError:  # another rank bound it first: connect to that one once it listens
                time.sleep(min(0.01 * attempt, 0.05))
        self._say("no relay for this host's windows; posting alone")
        return None

    def _say(self, what: str) -> None:
        if self._said != what:
            self._said = what
            log.info("stepwatch: %s", what)


class Relay:
    """The host's relay: one daemon thread serving the socket (``selectors``) and posting
    host batches. At most one per process and address."""

    @classmethod
    def start(cls, addr: bytes, url: str, headers: dict[str, str], timeout_s: float) -> Relay:
        """Bind ``addr`` and serve it; ``OSError`` when another process holds it."""
        with _lock:
            relay = _running.get(addr)
            if relay is not None and relay._thread.is_alive():
                return relay
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                listener.bind(addr)
                listener.listen(256)
            except OSError:
                listener.close()
                raise
            try:
                relay = cls(addr, listener, url, headers, timeout_s)
            except Exception:  # no socket pair or selector to be had (descriptors run out)
                listener.close()
                raise
            try:
                relay._thread.start()
            except RuntimeError as exc:  # no thread to be had (interpreter exiting, limits)
                relay._forked()
                raise OSError(f"cannot start the host's relay: {exc}") from exc
            _running[addr] = relay
            ref = weakref.ref(relay)
            os.register_at_fork(after_in_child=lambda: _after_fork(ref))
            return relay

    def __init__(
        self, addr: bytes, listener: socket.socket, url: str, headers: dict[str, str], timeout_s: float
    ) -> None:
        self._address = addr
        self._listener = listener
        self._base = url.rstrip("/")
        self._headers = {**headers, "content-type": "application/json"}
        self._timeout_s = timeout_s
        self._sel = selectors.DefaultSelector()
        self._buffers: dict[socket.socket, bytearray] = {}
        #: Entries waiting for the next host batch: (rank's connection, body).
        self._pending: list[tuple[socket.socket, bytes]] = []
        self._pending_bytes = 0
        self._first_at = 0.0
        #: Whether the collector has the host-batch route (an older one answers 404).
        self._batches_route = True
        #: The job's ranks on this host, as the launcher says (``_env.local_world_size``):
        #: a batch waits for them all (up to :data:`LINGER_S`) even before each has connected.
        self._local_ranks = _env.local_world_size()
        #: Host batches posted and entries relayed, for the curious (tests, a debugger).
        self.posts = 0
        self.entries = 0
        #: Set by :meth:`stop`; the thread sees it through a byte on ``_wake_w``.
        self._stopping = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._thread = threading.Thread(target=self._run, name="stepwatch-relay", daemon=True)

    def stop(self, timeout_s: float) -> None:
        """Hand the host's relaying on before this process goes (its agent closes): no rank
        connects here any more, and the entries that have reached this relay are posted
        as one last host batch and answered, instead of hung up on when the process exits
        (twice cost a rank a failed attempt and its backoff, at the end of a job, when its
        final window has the least time left). An entry still on its way is hung up on
        once: its rank then finds no relay and binds the address or posts alone, at once.
        Waits up to ``timeout_s`` for the thread (it may be posting a batch); past that,
        its process's exit hangs up on what it holds, as before."""
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")
        if self._thread.ident is not None and self._thread is not threading.current_thread():
            self._thread.join(max(0.0, timeout_s))

    # -- the relay's thread ------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        except BaseException:  # a bug here must not leave a bound socket nobody serves
            log.exception("stepwatch: the host's relay stopped; its ranks relay anew or post alone")
        finally:
            self._shut()

    def _serve(self) -> None:
        import httpx

        self._sel.register(self._listener, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        with httpx.Client(timeout=self._timeout_s, headers=self._headers) as client:
            while True:
                wait = None if not self._pending else max(0.0, self._first_at + LINGER_S - time.monotonic())
                for key, _ in self._sel.select(wait):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    if sock is self._listener:
                        self._accept()
                    elif sock is self._wake_r:
                        with contextlib.suppress(OSError):
                            sock.recv(64)
                    else:
                        self._read(sock)
                if self._stopping:
                    self._hand_on(client)
                    return
                if self._pending and (
                    not self._batches_route
                    or len(self._pending) >= max(len(self._buffers), self._local_ranks)
                    or time.monotonic() - self._first_at >= LINGER_S
                    or self._pending_bytes >= MAX_BATCH_BYTES
                    or len(self._pending) >= wire.MAX_HOST_BATCHES
                ):
                    batch, self._pending, self._pending_bytes = self._pending, [], 0
                    try:
                        self._post(client, batch)
                    except Exception:  # never the thread: each rank retries its own entry
                        log.exception("stepwatch: the host's relay failed on a batch")
                        for sock, _ in batch:
                            self._drop(sock)

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except OSError:
            return
        try:
            uid = _peer_uid(sock)
        except OSError:
            uid = -1
        if uid != os.getuid():  # the abstract namespace has no file permissions
            sock.close()
            return
        sock.setblocking(False)
        self._buffers[sock] = bytearray()
        self._sel.register(sock, selectors.EVENT_READ)

    def _read(self, sock: socket.socket) -> bool:
        """Read what ``sock`` has (its complete frames join the pending batch); whether it
        had anything (False: nothing yet, or the rank hung up)."""
        try:
            chunk = sock.recv(1 << 20)
        except BlockingIOError:
            return False
        except OSError:
            chunk = b""
        if not chunk:  # the rank is gone (its entry, if any, goes anyway: it is idempotent)
            self._drop(sock)
            return False
        buf = self._buffers[sock]
        buf += chunk
        while len(buf) >= _REQUEST.size:
            (n,) = _REQUEST.unpack_from(buf)
            if n > MAX_FRAME_BYTES:  # not a window: a confused peer, not a reason to grow
                self._drop(sock)
                return False
            if len(buf) < _REQUEST.size + n:
                break
            body = bytes(buf[_REQUEST.size : _REQUEST.size + n])
            del buf[: _REQUEST.size + n]
            if not self._pending:
                self._first_at = time.monotonic()
            self._pending.append((sock, body))
            self._pending_bytes += n
        return True

    def _hand_on(self, client: httpx.Client) -> None:
        """Stop relaying (see :meth:`stop`): the socket closed first, under the lock, so that
        a rank's next connect finds no relay (it binds the address itself, or posts
        alone), then the entries that reached it posted as one last host batch and each
        answered, as any batch's."""
        with _lock:
            self._listener.close()
            if _running.get(self._address) is self:
                del _running[self._address]
        for sock in list(self._buffers):  # entries that reached it before the socket closed
            while sock in self._buffers and self._read(sock):
                pass
        batch, self._pending, self._pending_bytes = self._pending, [], 0
        if batch:
            try:
                self._post(client, batch)
            except Exception:  # each rank retries its own entry
                log.exception("stepwatch: the host's relay failed on its last batch")

    def _drop(self, sock: socket.socket) -> None:
        if self._buffers.pop(sock, None) is not None:
            self._sel.unregister(sock)
        sock.close()

    def _post(self, client: httpx.Client, batch: list[tuple[socket.socket, bytes]]) -> None:
        """Post ``batch`` as one host batch and answer each rank its entry's result. When
        the collector is away or busy, each rank is told so (and waits, as alone); when it
        refuses or fails on the whole, each rank posts its own entry itself, at once, and
        gets the answer that entry gets (never N requests in a row from this thread)."""
        self.posts += 1
        self.entries += len(batch)
        if not self._batches_route:
            for sock, _ in batch:
                self._answer(sock, _ALONE_NO_ROUTE)
            return
        answer = self._http(client, wire.HOST_BATCH_PATH, wire.host_batch([b for _, b in batch]))
        outcome = Verdict.WAIT if answer.status == NO_ANSWER else verdict(answer.status)
        if outcome is Verdict.DONE:
            try:
                results = json.loads(answer.content)["results"]
                if len(results) != len(batch):
                    raise ValueError(f"{len(results)} results for {len(batch)} entries")
            except (ValueError, KeyError, TypeError) as exc:
                # Perhaps stored, perhaps not: a lone post of each entry says (stored once).
                log.warning("stepwatch: unreadable answer to a host batch (%s); its ranks post alone", exc)
                outcome = Verdict.REFUSED
            else:
                for (sock, _), result in zip(batch, results, strict=True):
                    self._answer(sock, Answer(answer.status, None, json.dumps(result).encode()))
                return
        if outcome is Verdict.WAIT:  # away or busy: the same for each entry alone
            for sock, _ in batch:
                self._answer(sock, answer)
            return
        alone = _ALONE
        if answer.status in (404, 405):
            self._batches_route = False
            log.warning("stepwatch: the collector has no host-batch route; this host's ranks post alone")
            alone = _ALONE_NO_ROUTE
        for sock, _ in batch:
            self._answer(sock, alone)

    def _http(self, client: httpx.Client, path: str, body: bytes) -> Answer:
        import httpx

        try:
            resp = client.post(self._base + path, content=body)
        except (httpx.HTTPError, OSError) as exc:
            return Answer(NO_ANSWER, None, f"{type(exc).__name__}: {exc}".encode())
        return Answer(resp.status_code, retry_after_s(resp.headers.get("retry-after")), resp.content)

    def _answer(self, sock: socket.socket, answer: Answer) -> None:
        after = math.nan if answer.retry_after_s is None else answer.retry_after_s
        frame = _ANSWER.pack(answer.status, after, len(answer.content)) + answer.content
        try:
            sock.setblocking(True)
            sock.settimeout(1.0)
            sock.sendall(frame)
            sock.setblocking(False)
        except OSError:  # the rank is gone; it retries its entry if it comes back
            self._drop(sock)

    def _shut(self) -> None:
        """Close the socket and every connection (their ranks relay anew or post alone):
        the socket first, under the lock, so no rank connects to it meanwhile and the
        next ``start`` can bind the address."""
        with _lock:
            self._listener.close()
            if _running.get(self._address) is self:
                del _running[self._address]
        self._forked()

    def _forked(self) -> None:
        """In a forked child (a DataLoader worker): no thread serves these sockets here."""
        self._listener.close()
        for sock in list(self._buffers):
            sock.close()
        self._buffers.clear()
        self._pending.clear()
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()


#: The relays this process runs, by address, and the lock of starting one.
_running: dict[bytes, Relay] = {}
_lock = threading.Lock()


def stop_all(timeout_s: float) -> None:
    """Stop every relay this process runs (:meth:`Relay.stop`), within ``timeout_s``."""
    with _lock:
        relays = list(_running.values())
    deadline = time.monotonic() + max(0.0, timeout_s)
    for relay in relays:
        relay.stop(deadline - time.monotonic())


def _after_fork(ref: weakref.ref[Relay]) -> None:
    global _lock
    relay = ref()
    if relay is not None:
        relay._forked()
    _running.clear()
    _lock = threading.Lock()
