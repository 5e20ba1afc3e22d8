"""This rank's host-clock offset against rank 0, with its uncertainty.

Why: the collector splits each collective into *wait* and *transfer* by comparing the
ranks' enter times, which come from each host's own clock. Ranks of one host share that
clock (offset 0, exactly); across hosts, NTP keeps clocks within about a millisecond at
best, which is the size of the effect being measured, so the offset is measured.

How (Cristian's algorithm over the ``torch.distributed`` TCP store, all on a background
thread, never on the training thread and never as a collective):

* rank 0 publishes its host name and runs a *responder* (:func:`serve`): for each
  ticket ``n`` it acknowledges (``stepwatch/clock/ack/<n>``), watches for the request
  (``.../req/<n>``) and answers at once with its ``time.time()`` (``.../resp/<n>``);
* any rank on another host takes a ticket ``n`` (an atomic ``add`` on the store), waits
  for the ack, notes ``t0``, posts the request, blocks on the answer ``T``, notes
  ``t1``. Then
  ``offset = T - (t0 + t1) / 2`` and the error is at most ``(t1 - t0) / 2`` (rank 0
  read its clock somewhere inside the round trip). The round with the shortest round
  trip of a few is kept; the estimate is refreshed every ``interval_s`` (10 minutes).

``offset_s`` is what to *add* to this rank's Unix timestamps to put them on rank 0's
clock. The agent opens its own client connection to the store (``MASTER_ADDR`` /
``MASTER_PORT``), so a blocked request never holds the connection that training uses.
Without a reachable store, ranks on rank 0's host still report ``same-host``; others
report no offset (``None``), and the collector treats their clock as rank 0's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

log = logging.getLogger("stepwatch")

PREFIX = "stepwatch/clock/"


class Store(Protocol):
    """The part of ``torch.distributed.Store`` used here."""

    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def add(self, key: str, value: int) -> int: ...
    def check(self, keys: list[str]) -> bool: ...
    def delete_key(self, key: str) -> bool: ...


@dataclass(frozen=True)
class ClockEstimate:
    """Offset to add to this rank's clock to get rank 0's, and its error bound (seconds)."""

    offset_s: float
    uncertainty_s: float
    method: str  # "same-host" | "store"
    measured_at: float

    def to_dict(self) -> dict[str, Any]:
        return {"offset_s": self.offset_s, "uncertainty_s": self.uncertainty_s, "method": self.method}


def serve(
    store: Store,
    stop: threading.Event,
    *,
    clock: Callable[[], float] = time.time,
    poll_s: float = 0.2,
    give_up_s: float = 5.0,
) -> None:
    """Rank 0's responder loop: answer clock requests in ticket order until ``stop``.

    It polls the ticket counter (``poll_s``); for each new ticket it posts an *ack*,
    then watches for that ticket's request with a tight non-blocking ``check`` loop and
    answers with its clock at once. Clients start their stopwatch only after the ack,
    so the responder's polling delay is not part of the measured round trip. Only
    non-blocking store calls are used: a blocking wait that times out makes c10d log
    a warning each time, which would spam rank 0's log while it idles. A ticket whose
    request never comes (its rank died) is given up after ``give_up_s``.
    """
    n = 0
    while not stop.is_set():
        try:
            taken = store.add(f"{PREFIX}seq", 0)
        except Exception:
            taken = n
        if taken <= n:
            stop.wait(poll_s)
            continue
        req = f"{PREFIX}req/{n}"
        store.set(f"{PREFIX}ack/{n}", "1")
        deadline = time.monotonic() + give_up_s
        while not stop.is_set() and time.monotonic() < deadline:
            if store.check([req]):
                store.set(f"{PREFIX}resp/{n}", repr(clock()))
                break
            time.sleep(0.0002)
        n += 1


def measure(store: Store, *, rounds: int = 5, clock: Callable[[], float] = time.time) -> ClockEstimate:
    """Client side: the best of ``rounds`` request/answer round trips with rank 0."""
    best: tuple[float, float] | None = None  # (round trip, offset)
    for _ in range(rounds):
        n = store.add(f"{PREFIX}seq", 1) - 1
        store.get(f"{PREFIX}ack/{n}")  # blocks until rank 0 watches for this request
        t0 = clock()
        store.set(f"{PREFIX}req/{n}", "1")
        theirs = float(store.get(f"{PREFIX}resp/{n}").decode())
        t1 = clock()
        for k in ("ack", "req", "resp"):
            with contextlib.suppress(Exception):  # tiny keys; a store without delete keeps them
                store.delete_key(f"{PREFIX}{k}/{n}")
        rtt = t1 - t0
        if best is None or rtt < best[0]:
            best = (rtt, theirs - (t0 + t1) / 2.0)
    if best is None:
        raise ValueError("rounds must be >= 1")
    return ClockEstimate(offset_s=best[1], uncertainty_s=best[0] / 2.0, method="store", measured_at=clock())


class ClockSync:
    """Keeps :attr:`estimate` fresh from a daemon thread (see the module docstring)."""

    def __init__(
        self,
        rank: int,
        host: str,
        *,
        connect: Callable[[], Store | None] | None = None,
        interval_s: float = 600.0,
        clock: Callable[[], float] = time.time,
        single_host: bool = False,
    ) -> None:
        self.rank = rank
        self.single_host = single_host
        self.host = host
        self.interval_s = interval_s
        self._clock = clock
        self._connect = connect or connect_from_env
        self.estimate: ClockEstimate | None = None
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def start(self) -> None:
        """Start the thread once (per process: a forked child starts its own)."""
        if self.single_host or (self.rank == 0 and self.estimate is None):
            self.estimate = ClockEstimate(0.0, 0.0, "same-host", self._clock())
        if self.single_host:
            return
        if self._thread is not None and self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stepwatch-clock", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        try:
            store = self._connect()
        except Exception as exc:
            store = None
            self.error = f"store: {exc!r}"[:200]
        if self.rank == 0:
            self.estimate = ClockEstimate(0.0, 0.0, "same-host", self._clock())
            if store is None:
                return
            try:
                store.set(f"{PREFIX}host0", self.host)
                serve(store, self._stop, clock=self._clock)
            except Exception as exc:
                self.error = f"responder: {exc!r}"[:200]
            return
        if store is None:
            return
        while not self._stop.is_set():
            try:
                host0 = store.get(f"{PREFIX}host0").decode()
                if host0 == self.host:
                    self.estimate = ClockEstimate(0.0, 0.0, "same-host", self._clock())
                    return
                self.estimate = measure(store, clock=self._clock)
                self.error = None
            except Exception as exc:
                self.error = f"measure: {exc!r}"[:200]
                log.debug("stepwatch: clock offset not measured: %r", exc)
            if self._stop.wait(self.interval_s):
                return


def connect_from_env(timeout_s: float = 30.0) -> Store | None:
    """A new client connection to the job's TCP store at ``MASTER_ADDR:MASTER_PORT``."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    import torch.distributed as dist

    store: Store = dist.TCPStore(  # type: ignore[attr-defined]
        addr, int(port), is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )
    return store
