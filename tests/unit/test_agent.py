"""The agent's hot path and window hand-off, with a recording sender in place of HTTP
(the sender itself is tested against a real collector in tests/integration)."""

from __future__ import annotations

import json
import warnings

import pytest

import stepwatch
from stepwatch import _agent
from stepwatch._env import detect
from stepwatch._payload import build_payload, encode
from stepwatch._sender import MemorySink
from stepwatch.config import AgentConfig, load


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    c = FakeClock()
    monkeypatch.setattr(_agent, "_perf", c)
    return c


def make(cfg: AgentConfig, sender: MemorySink) -> stepwatch.Stepwatch:
    return stepwatch.Stepwatch(cfg, detect({}, host="h"), convention=None, sender=sender)


def test_windows_close_on_capacity_and_keep_every_step(clock: FakeClock) -> None:
    rec = MemorySink()
    sw = make(AgentConfig(run="r", max_window_steps=4, send_interval_s=1e9, warmup_steps=0), rec)
    for i in range(10):
        clock.t += 0.25
        sw.step(tokens=100 + i)
    sw.close()
    assert [w.first_step for w in rec.windows] == [1, 5, 9]
    assert [w.n_steps for w in rec.windows] == [4, 4, 2]
    assert [t for w in rec.windows for t in w.tokens] == list(range(100, 110))
    assert all(dt == pytest.approx(0.25) for w in rec.windows for dt in w.step_time_s)
    assert rec.closed


def test_windows_close_on_time(clock: FakeClock) -> None:
    rec = MemorySink()
    sw = make(AgentConfig(run="r", send_interval_s=1.0, warmup_steps=0), rec)
    for _ in range(7):
        clock.t += 0.3
        sw.step(tokens=1)
    # 0.3 s steps and a 1 s interval: windows close after steps 4 (1.2 s) ...
    assert [w.n_steps for w in rec.windows] == [4]
    for _ in range(2):
        clock.t += 0.3
        sw.step(tokens=1)
    assert [w.n_steps for w in rec.windows] == [4, 4]


def test_loader_wait_is_charged_to_the_step_that_uses_the_batch(clock: FakeClock) -> None:
    rec = MemorySink()
    sw = make(AgentConfig(run="r", max_window_steps=8, warmup_steps=0), rec)

    def slow_batches():  # type: ignore[no-untyped-def]
        for i in range(3):
            clock.t += 0.1 * (i + 1)  # the loader takes 0.1, 0.2, 0.3 s
            yield i

    for _ in sw.loader(slow_batches()):
        clock.t += 1.0  # compute
        sw.step(tokens=1)
    sw.flush()
    (w,) = rec.windows
    assert list(w.data_wait_s) == pytest.approx([0.1, 0.2, 0.3])
    assert list(w.step_time_s) == pytest.approx([1.1, 1.2, 1.3])


def test_warmup_and_marked_steps_are_tagged(clock: FakeClock) -> None:
    rec = MemorySink()
    sw = make(AgentConfig(run="r", max_window_steps=3, warmup_steps=4), rec)
    for i in range(6):
        if i == 5:
            with sw.phase("checkpoint"):
                pass
        clock.t += 0.1
        sw.step(tokens=1)
    sw.flush()
    tags = [t for w in rec.windows for t in w.tags]  # type: ignore[union-attr]
    assert tags == [1, 1, 1, 1, 0, 2]
    with pytest.raises(ValueError, match="unknown tag"):
        sw.mark("lunch")


def test_padded_tokens_only_when_given(clock: FakeClock) -> None:
    rec = MemorySink()
    sw = make(AgentConfig(run="r", max_window_steps=2, warmup_steps=0), rec)
    sw.step(tokens=3)
    sw.step(tokens=3)
    sw.step(tokens=3, padded_tokens=4)
    sw.step(tokens=3, padded_tokens=4)
    assert rec.windows[0].padded_tokens is None
    assert list(rec.windows[1].padded_tokens or []) == [4, 4]


def test_non_int_counts_take_the_slow_path(clock: FakeClock) -> None:
    import numpy as np
    import torch

    rec = MemorySink()
    sw = make(AgentConfig(run="r", max_window_steps=3, warmup_steps=0), rec)
    sw.step(tokens=np.int64(7))
    sw.step(tokens=torch.tensor(8))
    sw.step(tokens=9.0)  # type: ignore[arg-type]
    assert list(rec.windows[0].tokens) == [7, 8, 9]


def test_internal_error_disables_the_agent_and_never_raises(clock: FakeClock) -> None:
    rec = MemorySink()
    sw = make(AgentConfig(run="r", max_window_steps=4, warmup_steps=0), rec)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sw.step(tokens="not a number")  # type: ignore[arg-type]
        sw.step(tokens=1)
    assert any("stepwatch disabled itself" in str(w.message) for w in caught)
    assert sw.stats["steps"] == 0


def test_disabled_by_environment(clock: FakeClock) -> None:
    rec = MemorySink()
    cfg = load("r", env={"STEPWATCH_DISABLED": "1"})
    sw = make(cfg, rec)
    sw.step(tokens=1)
    sw.close()
    assert rec.windows == []


def test_config_validation_names_the_setting() -> None:
    with pytest.raises(ValueError, match="run name"):
        load("has space", env={})
    with pytest.raises(ValueError, match="STEPWATCH_SEND_INTERVAL_S"):
        load("r", env={"STEPWATCH_SEND_INTERVAL_S": "soon"})
    cfg = load(None, env={"STEPWATCH_RUN": "from-env", "STEPWATCH_URL": "http://c:1", "STEPWATCH_TOKEN": "t"})
    assert (cfg.run, cfg.url, cfg.token) == ("from-env", "http://c:1", "t")


@pytest.mark.parametrize(
    ("env", "explicit", "expected"),
    [
        ({}, None, False),  # a lone process: no one to batch with
        ({"LOCAL_WORLD_SIZE": "1"}, None, False),
        ({"LOCAL_WORLD_SIZE": "8"}, None, True),  # torchrun, 8 ranks on the host: on by default
        ({"LOCAL_WORLD_SIZE": "8", "STEPWATCH_HOST_BATCH": "0"}, None, False),
        ({"LOCAL_WORLD_SIZE": "8", "STEPWATCH_HOST_BATCH": "off"}, None, False),
        ({"LOCAL_WORLD_SIZE": "8", "STEPWATCH_HOST_BATCH": ""}, None, True),  # empty: the default
        ({"LOCAL_WORLD_SIZE": "8", "STEPWATCH_HOST_BATCH": "auto"}, None, True),
        ({"STEPWATCH_HOST_BATCH": "Auto"}, None, False),
        ({"STEPWATCH_HOST_BATCH": "1"}, None, True),
        ({"LOCAL_WORLD_SIZE": "8", "STEPWATCH_HOST_BATCH": "1"}, False, False),  # init's argument wins
        ({}, True, True),
        ({"LOCAL_WORLD_SIZE": "many"}, None, False),
        # Slurm's srun sets no LOCAL_WORLD_SIZE; its tasks per node of the step say it.
        ({"SLURM_STEP_TASKS_PER_NODE": "8(x16)", "SLURM_NODEID": "3"}, None, True),
        ({"SLURM_STEP_TASKS_PER_NODE": "1(x16)"}, None, False),  # one rank a node
        ({"SLURM_STEP_TASKS_PER_NODE": "8(x16)", "STEPWATCH_HOST_BATCH": "0"}, None, False),
        # torchrun started by srun, one task a node: torchrun's count is the host's ranks.
        ({"SLURM_STEP_TASKS_PER_NODE": "1(x16)", "LOCAL_WORLD_SIZE": "8"}, None, True),
        ({"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, None, True),  # Open MPI's mpirun
    ],
)
def test_host_batching_is_on_where_the_host_runs_several_ranks(
    env: dict[str, str], explicit: bool | None, expected: bool
) -> None:
    assert load("r", env=env, host_batch=explicit).host_batch is expected


def test_a_bad_host_batch_setting_is_named() -> None:
    with pytest.raises(ValueError, match="STEPWATCH_HOST_BATCH must be 1/0"):
        load("r", env={"STEPWATCH_HOST_BATCH": "sometimes"})


def test_payload_is_compact_json_with_identity_and_convention(clock: FakeClock) -> None:
    rec = MemorySink()
    sw = make(AgentConfig(run="r", max_window_steps=100, send_interval_s=1e9, warmup_steps=0), rec)
    for _ in range(100):
        clock.t += 1.0
        sw.step(tokens=4096)
    w = rec.windows[0]
    w.batch_id = "a" * 32
    body = encode(
        build_payload(w, run="r", rank=sw.rank.to_dict(), convention={"formula": "6N"}, agent={}, sent_at=1.0)
    )
    doc = json.loads(body)
    assert doc["schema_version"] == 2 and doc["rank"]["rank"] == 0 and doc["convention"]["formula"] == "6N"
    assert doc["steps"]["first"] == 1 and len(doc["steps"]["time_s"]) == 100
    assert len(body) < 2500, "a 100-step window should stay a couple of KB"


def test_init_returns_a_working_agent_and_repeated_init_replaces_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPWATCH_URL", "http://127.0.0.1:9")  # discard port: nothing listens
    a = stepwatch.init(run="first", peak_flops=1e12, flops_per_token=1e6, flush_timeout_s=0.1)
    b = stepwatch.init(run="second", peak_flops=1e12, flops_per_token=1e6, flush_timeout_s=0.1)
    assert stepwatch.current() is b and a is not b
    assert a._closed and not b._closed
    assert b.convention is not None and b.convention["flops_per_token"] == 1e6
    b.step(tokens=1)
    assert b.close(timeout_s=0.1) in (True, False)


def test_common_steps_read_the_clock_once_and_time_themselves_one_in_64(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reads = [0]

    def counting_clock() -> float:
        reads[0] += 1
        return 1000.0 + reads[0] * 1e-6  # every read 1 us after the one before

    monkeypatch.setattr(_agent, "_perf", counting_clock)
    rec = MemorySink()
    sw = make(AgentConfig(run="r", max_window_steps=1024, send_interval_s=1e9, warmup_steps=0), rec)
    reads[0] = 0
    for _ in range(640):
        sw.step(tokens=1)
    assert reads[0] == 640 + 10  # slots 1, 65, ... 577 time themselves
    mean = sw.stats["hot_path_mean_s"]
    assert mean == pytest.approx(1e-6)  # each sampled step: one read after its own
    sw.close()
    assert [w.n_steps for w in rec.windows] == [640]


def test_the_sender_thread_starts_at_init_not_at_the_first_window() -> None:
    import threading

    from stepwatch.demo.launch import free_port

    # Thread objects, not idents: a thread that ends meanwhile (another test's sender,
    # under xdist) frees its ident for the new one (seen on a fresh clone).
    before = set(threading.enumerate())
    sw = stepwatch.Stepwatch(
        AgentConfig(run="r", url=f"http://127.0.0.1:{free_port()}"), detect({}, host="h"), convention=None
    )
    try:
        started = [t for t in threading.enumerate() if t not in before]
        assert [t.name for t in started] == ["stepwatch-sender"] and started[0].is_alive()
    finally:
        sw.close(0.1)


def test_disabled_agent_records_nothing_and_says_so_once(clock: FakeClock) -> None:
    rec = MemorySink()
    sw = make(AgentConfig(run="r", max_window_steps=4, send_interval_s=1e9, warmup_steps=0), rec)
    sw.step(tokens=1)
    tokens, sw._tokens = sw._tokens, None  # type: ignore[assignment]  # the next step fails inside
    with pytest.warns(RuntimeWarning, match="disabled itself"):
        sw.step(tokens=2)
    sw._tokens = tokens
    for _ in range(10):  # past the window's capacity: nothing is written, nothing raises
        clock.t += 1.0
        sw.step(tokens=3)
    assert sw.stats["steps"] == 1 and rec.windows == []


def test_a_wait_and_tag_charged_before_a_flush_ride_with_their_step(clock: FakeClock) -> None:
    rec = MemorySink()
    sw = make(AgentConfig(run="r", max_window_steps=4, send_interval_s=1e9, warmup_steps=0), rec)
    sw.step(tokens=1)
    sw.add_data_wait(0.5)
    sw.mark("eval")
    sw.flush()  # between the loader and the step it fed
    sw.step(tokens=2)
    sw.step(tokens=3)
    sw.close()
    assert [list(w.data_wait_s) for w in rec.windows] == [[0.0], [0.5, 0.0]]
    assert [list(w.tags or []) for w in rec.windows] == [[0], [3, 0]]


def test_the_relay_socket_is_one_per_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """With host batching on by default, two jobs of one user on a node (same collector,
    same token) must not share a relay: each waits for its own ``LOCAL_WORLD_SIZE`` ranks.
    torchrun gives every rank of a job the same ``MASTER_ADDR:MASTER_PORT``."""
    from stepwatch import _relay

    url = "http://collector:8000"
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    job_a = _relay.address(url, "t")
    assert _relay.address(url + "/", "t") == job_a  # the same job: one socket
    monkeypatch.setenv("MASTER_PORT", "29501")
    assert _relay.address(url, "t") != job_a  # a second job on the node
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert _relay.address(url, "other") != job_a  # another token
    assert _relay.address(url, "t").startswith(b"\0stepwatch-relay-")


def test_two_slurm_jobs_on_a_node_get_a_relay_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``srun`` the job is Slurm's job and step, whatever the rendezvous variables
    (the same default port in two jobs, or none: a ``tcp://`` init method)."""
    from stepwatch import _relay

    url = "http://collector:8000"
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    step_0 = _relay.address(url, "t")
    assert _relay.address(url, "t") == step_0  # every rank of the step: one socket
    monkeypatch.setenv("SLURM_STEP_ID", "1")
    assert _relay.address(url, "t") != step_0  # a second step of the job, beside it
    monkeypatch.setenv("SLURM_JOB_ID", "4243")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    assert _relay.address(url, "t") != step_0  # another job
