"""Clock offset against rank 0 over a real torch.distributed TCPStore on loopback.

Both "ranks" run in this process and share one clock, so a known skew is injected into
the client's clock function: the measured offset must recover it within the reported
uncertainty.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

dist = pytest.importorskip("torch.distributed")

from stepwatch._clock_sync import PREFIX, ClockSync, measure, serve  # noqa: E402

from ..wait import wait_until  # noqa: E402


@pytest.fixture
def store() -> object:
    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )


def _client(master: object) -> object:
    return dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=10))  # type: ignore[attr-defined]


def test_offset_is_recovered_within_its_uncertainty(store: object) -> None:
    stop = threading.Event()
    responder = threading.Thread(
        target=serve, args=(_client(store), stop), kwargs={"give_up_s": 0.5}, daemon=True
    )
    responder.start()
    try:
        skew = 2.5  # this client's clock is 2.5 s ahead of rank 0's: offset -2.5 s
        est = measure(_client(store), rounds=5, clock=lambda: time.time() + skew)  # type: ignore[arg-type]
        assert est.method == "store"
        assert 0 <= est.uncertainty_s < 0.05
        assert abs(est.offset_s + skew) <= est.uncertainty_s + 1e-3
        # A ticket taken by a client that died before asking is given up, not waited on forever.
        _client(store).add(f"{PREFIX}seq", 1)  # type: ignore[attr-defined]
        again = measure(_client(store), rounds=1)  # type: ignore[arg-type]
        assert abs(again.offset_s) <= again.uncertainty_s + 1e-3
    finally:
        stop.set()
        responder.join(5)
    assert not responder.is_alive()


def test_clock_sync_threads_same_host_and_other_host(store: object) -> None:
    rank0 = ClockSync(0, "node0", connect=lambda: _client(store))  # type: ignore[arg-type,return-value]
    rank0.start()
    assert rank0.estimate is not None and rank0.estimate.method == "same-host"
    local = ClockSync(1, "node0", connect=lambda: _client(store))  # type: ignore[arg-type,return-value]
    remote = ClockSync(8, "node1", connect=lambda: _client(store), clock=lambda: time.time() - 1.0)  # type: ignore[arg-type,return-value]
    try:
        local.start()
        remote.start()
        wait_until(lambda: local.estimate is not None and remote.estimate is not None, "both estimates")
        assert local.estimate is not None and local.estimate.to_dict() == {
            "offset_s": 0.0,
            "uncertainty_s": 0.0,
            "method": "same-host",
        }
        assert remote.estimate is not None and remote.estimate.method == "store"
        assert abs(remote.estimate.offset_s - 1.0) <= remote.estimate.uncertainty_s + 1e-3
    finally:
        for s in (rank0, local, remote):
            s.stop()


def test_without_a_store_only_single_host_jobs_know_their_offset() -> None:
    single = ClockSync(3, "h", connect=lambda: None, single_host=True)
    single.start()
    assert single.estimate is not None and single.estimate.offset_s == 0.0
    lost = ClockSync(3, "h", connect=lambda: None)
    lost.start()
    assert lost._thread is not None
    lost._thread.join(5)
    assert lost.estimate is None
