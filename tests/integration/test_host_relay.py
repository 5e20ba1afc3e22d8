"""Per-host batching (``stepwatch._relay``): real rank processes on one host, each with the
agent's real sender, through the host's relay (a Unix socket) to a real collector over
loopback HTTP. The collector's requests are counted by an ASGI wrapper around the real app."""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import signal
import socket
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.synchronize import Event
from typing import Any

import pytest
from sqlalchemy import Engine, text
from starlette.types import ASGIApp, Receive, Scope, Send

from stepwatch import wire

from ..live import serve_in_thread
from ..wait import wait_until
from .relay_processes import RUN, STEPS, TIMEOUT_S, rank_main, relay_main, squat


class Requests:
    """Counts the collector's requests by method and path (around the real app); with
    ``host_status``, answers the host-batch route with that status instead (a collector
    failing on it, or an older one without it)."""

    def __init__(self, host_status: int | None = None) -> None:
        self.seen: Counter[tuple[str, str]] = Counter()
        self.host_status = host_status

    def wrap(self, app: ASGIApp) -> ASGIApp:
        async def counted(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http":
                self.seen[scope["method"], scope["path"]] += 1
                if self.host_status is not None and scope["path"] == wire.HOST_BATCH_PATH:
                    while (await receive()).get("more_body"):
                        pass
                    body = json.dumps({"detail": "not today"}).encode()
                    headers = [(b"content-type", b"application/json")]
                    await send(
                        {"type": "http.response.start", "status": self.host_status, "headers": headers}
                    )
                    await send({"type": "http.response.body", "body": body})
                    return
            await app(scope, receive, send)

        return counted


@contextmanager
def collector(db_url: str, host_status: int | None = None) -> Iterator[tuple[str, Requests]]:
    requests = Requests(host_status)
    with serve_in_thread(db_url, wrap=requests.wrap) as url:
        yield url, requests


def run_ranks(
    url: str, world: int, windows: int, **kwargs: Callable[[int], Any]
) -> dict[int, tuple[list[str], list[str], dict[str, Any]]]:
    """``world`` rank processes, started together once all are up (spawning one can take
    seconds on a loaded machine), as a job's ranks start stepping together."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    go = ctx.Event()
    procs = [
        ctx.Process(
            target=rank_main,
            args=(url, r, world, windows, out),
            kwargs={"go": go, "first": 0, **{k: f(r) for k, f in kwargs.items()}},
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    assert sorted(out.get(timeout=TIMEOUT_S)[1] for _ in procs) == list(range(world))
    go.set()
    got = {}
    for _ in procs:
        msg = out.get(timeout=TIMEOUT_S)
        got[msg[1]] = (msg[2], msg[3], msg[4])
    for p in procs:
        p.join(TIMEOUT_S)
        assert p.exitcode == 0
    return got


def release(go: Event, ranks: list[Any], out: Any) -> dict[int, tuple[Any, ...]]:
    """Let the waiting ``ranks`` go on; each one's report once all have exited."""
    go.set()
    got = {}
    for _ in ranks:
        msg = out.get(timeout=TIMEOUT_S)
        got[msg[1]] = msg
    for p in ranks:
        p.join(TIMEOUT_S)
        assert p.exitcode == 0
    return got


def delivered(got: dict[int, tuple[Any, ...]], windows: int, engine: Engine) -> None:
    """Every window of each rank in ``got`` answered (its own answers) and stored once."""
    for _, _, sent, answered, stats in got.values():
        # The window in flight when the relay died was encoded again for its retry.
        assert answered == once(sent), stats
        assert (stats["sent_batches"], stats["rejected_batches"]) == (windows + 1, 0), stats
    stored = steps_of(engine)
    assert {r: stored[r] for r in got} == dict.fromkeys(got, windows * STEPS)


def once(ids: list[str]) -> list[str]:
    return list(dict.fromkeys(ids))


def steps_of(engine: Engine) -> dict[int, int]:
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT w.rank, sum(w.n_steps) FROM rank_windows w JOIN runs r ON r.id = w.run_id "
                "WHERE r.name = :run GROUP BY w.rank"
            ),
            {"run": RUN},
        )
        return {int(r): int(n) for r, n in rows}


def test_a_hosts_windows_go_in_one_request_and_each_rank_gets_its_own_answer(
    db_url: str, engine: Engine
) -> None:
    world, windows = 4, 5
    with collector(db_url) as (url, requests):
        got = run_ranks(url, world, windows)
    for sent, answered, stats in got.values():
        # Each answer is the rank's own entry's, in order. (A window in flight when the
        # relaying rank exited is encoded again for its retry, through the next relay.)
        assert answered == once(sent)
        assert (stats["sent_batches"], stats["relayed_batches"], stats["rejected_batches"]) == (
            windows + 1,
        ) * 2 + (0,)
    assert steps_of(engine) == dict.fromkeys(range(world), windows * STEPS)
    entries = world * (windows + 1)  # and each rank's final batch
    posts = requests.seen["POST", wire.HOST_BATCH_PATH]
    assert requests.seen["POST", wire.INGEST_PATH] == 0
    # One request per host and window when the ranks' windows meet within the linger;
    # never one per entry.
    assert world <= posts < entries / 2, requests.seen


@pytest.mark.parametrize("backend", ["postgresql"])
def test_a_refused_entry_gets_its_own_answer_and_its_neighbours_are_stored(
    db_url: str, engine: Engine
) -> None:
    world, windows = 3, 2
    with collector(db_url) as (url, requests):
        got = run_ranks(url, world, windows, bad=lambda r: r == 2)
    for r in (0, 1):
        sent, answered, stats = got[r]
        assert answered == once(sent) and stats["sent_batches"] == windows + 1
    _, answered, stats = got[2]
    assert answered == [] and stats["rejected_batches"] == windows + 1
    assert "HTTP 422" in stats["last_error"] and "host" in stats["last_error"]
    assert steps_of(engine) == {0: windows * STEPS, 1: windows * STEPS}
    assert requests.seen["POST", wire.INGEST_PATH] >= 2 * windows  # the refused batches, entry by entry


@pytest.mark.parametrize("status", [500, 404])
def test_a_collector_failing_on_host_batches_or_without_the_route_gets_each_entry_alone(
    db_url: str, engine: Engine, status: int
) -> None:
    """A 5xx on the host batch (the collector failed on it) and a 404 (an older collector)
    cost no rank an attempt: each posts its own entry alone, at once, and all is stored."""
    world, windows = 3, 2
    with collector(db_url, host_status=status) as (url, requests):
        got = run_ranks(url, world, windows)
    for sent, answered, stats in got.values():
        assert answered == once(sent)
        assert (stats["sent_batches"], stats["rejected_batches"], stats["failed_attempts"]) == (
            windows + 1,
            0,
            0,
        ), stats
        assert stats["relayed_batches"] == 0, stats
    assert steps_of(engine) == dict.fromkeys(range(world), windows * STEPS)
    entries = world * (windows + 1)
    assert requests.seen["POST", wire.INGEST_PATH] == entries, requests.seen
    if status == 404:  # once per relay (the relaying rank may exit before the others)
        assert 1 <= requests.seen["POST", wire.HOST_BATCH_PATH] <= world, requests.seen


@pytest.mark.parametrize("backend", ["postgresql"])
def test_when_the_relay_is_killed_another_rank_relays_and_no_window_is_lost(
    db_url: str, engine: Engine
) -> None:
    """Rank 0 sends first (so it hosts the relay) and forks a child (a DataLoader worker,
    which must not keep the relay's socket); the others send a window through it; rank 0
    is SIGKILLed; the others' remaining windows still arrive, host-batched."""
    world, windows = 4, 4
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    go = ctx.Event()
    child = None
    with collector(db_url) as (url, requests):
        # Its own event, never set: a process killed inside a wait on a shared one would
        # leave that one's lock held.
        hold = ctx.Event()
        host = ctx.Process(
            target=rank_main, args=(url, 0, world, windows, out), kwargs={"go": hold, "fork": True}
        )
        host.start()
        try:
            _, rank, child = out.get(timeout=TIMEOUT_S)  # its first window sent: it relays
            assert rank == 0 and child
            others = [
                ctx.Process(target=rank_main, args=(url, r, world, windows, out), kwargs={"go": go})
                for r in range(1, world)
            ]
            for p in others:
                p.start()
            assert sorted(out.get(timeout=TIMEOUT_S)[1] for _ in others) == [1, 2, 3]
            assert host.pid is not None
            os.kill(host.pid, signal.SIGKILL)
            # Not join(): it waits for the process's sentinel pipe, which its forked child
            # still holds.
            wait_until(lambda: host.exitcode is not None, "the killed rank reaped")
            before = requests.seen.copy()
            got = release(go, others, out)
        finally:
            if child:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
    delivered(got, windows, engine)
    after = requests.seen - before
    assert after["POST", wire.HOST_BATCH_PATH] >= 1 and after["POST", wire.INGEST_PATH] == 0, after


@pytest.mark.parametrize("backend", ["postgresql"])
def test_a_stopped_relay_holds_the_hosts_windows_only_until_the_timeout(db_url: str, engine: Engine) -> None:
    """The relaying process is SIGSTOPped (frozen, its socket still bound): each other rank
    waits out one timeout, then posts alone; nothing is lost."""
    world, windows = 3, 3
    ctx = mp.get_context("spawn")
    out, go, hold = ctx.Queue(), ctx.Event(), ctx.Event()
    with collector(db_url) as (url, requests):
        host = ctx.Process(target=rank_main, args=(url, 0, world, windows, out), kwargs={"go": hold})
        host.start()
        try:
            assert out.get(timeout=TIMEOUT_S)[:2] == ("ready", 0)  # it relays
            others = [
                ctx.Process(
                    target=rank_main,
                    args=(url, r, world, windows, out),
                    kwargs={"go": go, "timeout_s": 1.0},
                )
                for r in range(1, world)
            ]
            for p in others:
                p.start()
            assert sorted(out.get(timeout=TIMEOUT_S)[1] for _ in others) == [1, 2]
            assert host.pid is not None
            os.kill(host.pid, signal.SIGSTOP)
            before = requests.seen.copy()
            got = release(go, others, out)
        finally:
            if host.pid is not None:
                os.kill(host.pid, signal.SIGKILL)
                os.kill(host.pid, signal.SIGCONT)
            wait_until(lambda: host.exitcode is not None, "the stopped rank reaped")
    delivered(got, windows, engine)
    after = requests.seen - before
    assert after["POST", wire.INGEST_PATH] >= 2 * (windows - 1), after  # alone, past the timeout


@contextmanager
def relay_process(url: str) -> Iterator[None]:
    """A process relaying for ``url`` (no rank in it), until the block ends."""
    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=relay_main, args=(url, out, stop))
    proc.start()
    try:
        assert out.get(timeout=TIMEOUT_S) == "relaying"
        yield
    finally:
        stop.set()
        proc.join(TIMEOUT_S)


def test_a_collector_that_gives_no_answer_costs_one_request_per_host_batch() -> None:
    """No HTTP answer (down, reset) is the same for every entry: the rank is told so and
    retries, as alone; the relay does not try each entry alone in turn."""
    from stepwatch import _relay

    accepted: list[int] = []
    with socket.create_server(("127.0.0.1", 0)) as server:

        def hang_up() -> None:  # reads each request, then closes without an answer
            with contextlib.suppress(OSError):
                while True:
                    conn, _ = server.accept()
                    with conn:
                        accepted.append(len(conn.recv(1 << 16)))

        thread = threading.Thread(target=hang_up, daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
        try:
            with relay_process(url):
                answer = _relay.RelayClient(url, None, {}, 1.0).post(b"{}", 1.0)
        finally:
            server.shutdown(socket.SHUT_RDWR)  # wakes the accept
            thread.join(TIMEOUT_S)
        assert answer is not None and answer.status == _relay.NO_ANSWER, answer
        # Closed without an answer: a clean close, or a reset where the request was not
        # all read yet (a loaded machine delivers it in pieces).
        assert b"RemoteProtocolError" in answer.content or b"reset by peer" in answer.content, answer
        assert len(accepted) == 1, accepted


def test_a_relay_that_fails_on_every_batch_sends_its_ranks_alone() -> None:
    """A relay that takes the entry and hangs up (as one whose thread fails on each batch
    does): the rank tries once more at once, and retries later (a relaying rank that was
    exiting is gone by then); after HUNG_UP_POSTS such posts it posts alone, instead of
    retrying through the same relay for ever."""
    from stepwatch import _relay

    url = "http://127.0.0.1:9/failing-relay"  # an address of its own
    taken: list[bytes] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(_relay.address(url, None))
        listener.listen(8)

        def hang_up() -> None:
            with contextlib.suppress(OSError):
                while True:
                    conn, _ = listener.accept()
                    with conn:
                        taken.append(conn.recv(1 << 16))

        thread = threading.Thread(target=hang_up, daemon=True)
        thread.start()
        try:
            client = _relay.RelayClient(url, None, {}, 1.0)
            for _ in range(_relay.HUNG_UP_POSTS - 1):
                with pytest.raises(ConnectionResetError):
                    client.post(b'{"n": 1}', 1.0)
            assert client.post(b'{"n": 1}', 1.0) is None
        finally:
            listener.shutdown(socket.SHUT_RDWR)  # wakes the accept: the address is free
            thread.join(TIMEOUT_S)
    assert taken == [b'\0\0\0\x08{"n": 1}'] * 2 * _relay.HUNG_UP_POSTS, taken


def test_a_relay_whose_agent_closes_posts_what_it_holds_and_hands_its_address_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The relaying rank finishes first, while another rank's final window waits in its
    relay for the host batch: the relay posts it (one last host batch) and answers it,
    where its process's exit hung up on it (twice cost that rank a failed attempt and its
    backoff at the end of the job), closes its socket, and the next rank to come binds
    the address. (The collector here is away: the answer says so.)"""
    from stepwatch import _relay

    monkeypatch.setattr(_relay, "LINGER_S", TIMEOUT_S)  # the entry waits for its host batch
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    url = "http://127.0.0.1:9/closing-relay"  # an address of its own; nothing listens there
    addr = _relay.address(url, None)
    relay = _relay.Relay.start(addr, url, {}, 1.0)
    answers: list[Any] = []
    client = _relay.RelayClient(url, None, {}, 1.0)
    posting = threading.Thread(target=lambda: answers.append(client.post(b'{"n": 1}', 1.0)))
    posting.start()
    wait_until(lambda: relay._pending, "the entry waiting in the relay")
    _relay.stop_all(TIMEOUT_S)
    posting.join(TIMEOUT_S)
    (answer,) = answers
    assert answer is not None and answer.status == _relay.NO_ANSWER, "answered, not hung up on"
    assert (relay.posts, relay.entries) == (1, 1) and addr not in _relay._running
    again = _relay.Relay.start(addr, url, {}, 1.0)  # the address is free for the next rank
    assert again is not relay
    again.stop(TIMEOUT_S)
    client.close()


def test_a_rank_waits_for_a_relay_that_is_bound_but_not_yet_listening(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another rank has bound the relay's address and is descheduled before its listen
    (a loaded host): this rank connects once it listens, instead of posting alone (it gave
    up after four tries within 60 ms). The wait
    is stretched to the suite's timeout here, so that a loaded machine's late timer thread
    cannot fail the test: what it checks is that the rank waits, not how long."""
    from stepwatch import _relay

    monkeypatch.setattr(_relay, "START_RACE_S", TIMEOUT_S)
    url = "http://127.0.0.1:9/slow-binder"  # an address of its own
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(_relay.address(url, None))
        # The binder listens 0.3 s later: the scenario itself (the client's attempts in
        # between are refused), not a wait for anything.
        late = threading.Timer(0.3, listener.listen, args=(8,))
        late.start()
        try:
            sock = _relay.RelayClient(url, None, {}, 1.0)._connect()
            assert sock is not None, "the rank gave up on a relay that listened 0.3 s late"
            conn, _ = listener.accept()
            conn.close()
            sock.close()
        finally:
            late.join(TIMEOUT_S)


def test_a_rank_never_hands_its_window_to_another_users_socket() -> None:
    """Another user binding the address first gets a connection, never the window: the
    rank posts alone. (Root only: it takes a second user.)"""
    from stepwatch import _relay

    assert os.getuid() == 0, "this suite runs as root (network namespaces, another user)"
    url = "http://127.0.0.1:9/squatted"  # an address of its own (tests run in parallel)
    ctx = mp.get_context("spawn")
    ready, got = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=squat, args=(_relay.address(url, None), ready, got))
    proc.start()
    try:
        assert ready.get(timeout=TIMEOUT_S) == "bound"
        client = _relay.RelayClient(url, None, {}, 1.0)
        assert client.post(b'{"secret": 1}', 1.0) is None  # post alone
        assert got.get(timeout=TIMEOUT_S) == b""  # connected, then closed unsent
        assert client.post(b'{"secret": 2}', 1.0) is None  # and alone for a while, unasked
    finally:
        proc.join(TIMEOUT_S)
        if proc.exitcode is None:
            proc.kill()


def test_the_relay_answers_only_its_own_user() -> None:
    """The abstract socket has no file permissions: the relay checks the peer's uid.
    (Root only: it takes a second user.)"""
    from stepwatch import _relay

    assert os.getuid() == 0, "this suite runs as root (network namespaces, another user)"
    url = "http://127.0.0.1:9/own-user"  # nothing listens: the relay answers "no answer"
    with relay_process(url):
        answer = _relay.RelayClient(url, None, {}, 1.0).post(b"{}", 1.0)
        assert answer is not None and answer.status == _relay.NO_ANSWER and b"Connect" in answer.content
        addr = _relay.address(url, None)  # this user's (the address names the user)
        pid = os.fork()  # another user, at that address: closed unanswered
        if pid == 0:
            code = 1
            try:
                os.setuid(65534)
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                    sock.settimeout(TIMEOUT_S)
                    sock.connect(addr)
                    code = 3
                    try:
                        sock.sendall(b"\0\0\0\2{}")
                        code = 0 if sock.recv(64) == b"" else 2
                    except ConnectionError:  # closed before the request was all sent
                        code = 0
            finally:
                os._exit(code)
        assert os.waitpid(pid, 0)[1] == 0
