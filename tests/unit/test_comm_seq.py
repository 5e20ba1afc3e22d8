"""The hook's per-group collective counters and the heartbeat that carries them while the
training thread is stuck: what a hang's diagnosis reads (the sender and the collector
are tested over real HTTP in tests/integration/test_hang_diagnosis.py)."""

from __future__ import annotations

import json

import pytest

import stepwatch
from stepwatch import _comm_timing
from stepwatch._comm_timing import OP_CODES, SEQ_RING, CommTiming
from stepwatch._env import detect
from stepwatch._sender import MemorySink, SenderStats
from stepwatch.config import AgentConfig
from stepwatch_server.schemas.ingest import IngestPayload


class Clock:
    def __init__(self) -> None:
        self.t = 500.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def perf(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(_comm_timing, "_perf", c)
    monkeypatch.setattr(_comm_timing, "_wall", lambda: c.t + 1.7e9)  # the wall clock, a fixed offset away
    return c


def test_a_rank_inside_a_collective_reports_that_one_with_its_op_and_entry_time(perf: Clock) -> None:
    t = CommTiming(8, lambda: (1, 0))
    tokens = []
    for b in range(3):  # one step's three buckets: 1 and 2 complete, 3 stays in flight
        perf.t += 1.0
        tokens.append(t.arrive("world", b, 64))
    t.done(tokens[0], "world")
    t.done(tokens[1], "world")
    perf.t += 1.0
    t.arrive("7", 0, 8, op=OP_CODES["all_gather"])
    offset = 1.7e9
    side, world = t.groups()  # sorted by name: "7" < "world"
    assert side == {
        "group": "7",
        "entered": 1,
        "completed": 0,
        "op": "all_gather",
        "since": pytest.approx(504.0 + offset, abs=1e-3),
    }
    assert (world["group"], world["entered"], world["completed"], world["op"]) == (
        "world",
        3,
        2,
        "all_reduce",
    )
    assert world["since"] == pytest.approx(503.0 + offset, abs=1e-3)  # bucket 3's entry
    t.done(tokens[2], "world")
    (_, world) = t.groups()
    # Nothing in flight: the last collective entered.
    assert (world["entered"], world["completed"], world["since"]) == (
        3,
        3,
        pytest.approx(503.0 + offset, abs=1e-3),
    )


def test_counters_keep_counting_past_the_window_and_the_ring(perf: Clock) -> None:
    slot = [0]
    t = CommTiming(2, lambda: (1, slot[0]))
    slot[0] = 5  # past the window's capacity: no timing slot, still counted
    token = t.arrive("world", 0, 8)
    assert token == (1, -1)
    t.done(token, "world")
    for _ in range(SEQ_RING + 3):  # more in flight than the ring holds: no op, no time
        t.arrive("world", 0, 8)
    [g] = t.groups()
    assert (g["entered"], g["completed"]) == (SEQ_RING + 4, 1)
    assert "op" not in g and "since" not in g


def test_the_hot_path_allocates_nothing_that_grows_per_collective(perf: Clock) -> None:
    t = CommTiming(4, lambda: (1, 0))
    t.arrive("world", 0, 8)
    g = t.seq["world"]
    ops, times = g.ops, g.times
    for _ in range(10 * SEQ_RING):
        t.done(t.arrive("world", 0, 8), "world")
    assert t.seq["world"] is g and g.ops is ops and g.times is times
    assert len(g.ops) == len(g.times) == SEQ_RING


def test_a_heartbeat_carries_the_counters_and_no_step_and_is_a_valid_batch() -> None:
    rec = MemorySink()
    sw = stepwatch.Stepwatch(
        AgentConfig(run="r", send_interval_s=1e9, warmup_steps=0),
        detect({}, host="h"),
        convention=None,
        sender=rec,
    )
    assert sw._heartbeat() is None  # no communication hook: nothing to say
    for _ in range(3):
        sw.comm_timing.done(sw.comm_timing.arrive("world", 0, 8), "world")
        sw.step(tokens=1)
    sw.flush()
    sw.comm_timing.arrive("world", 0, 8)  # the next step's collective: stuck in it
    beat = sw._heartbeat()
    assert beat is not None and beat.heartbeat and beat.n_steps == 0
    assert beat.first_step == 4 and beat.wall_end == rec.windows[-1].wall_end
    body = json.loads(sw._encode(beat, SenderStats()))
    assert body["heartbeat"] is True and "final" not in body
    assert body["comm"]["idle_s"] >= 0
    assert body["comm"]["groups"][0] | {"since": 0} == {
        "group": "world",
        "entered": 4,
        "completed": 3,
        "op": "all_reduce",
        "since": 0,
    }
    p = IngestPayload.model_validate(body)
    assert p.steps.time_s == [] and p.steps.first == 4 and p.comm is not None
    sw.comm_timing.arrive("world", 1, 8)
    again = json.loads(sw._encode(beat, SenderStats()))  # a retry: the same batch and counters
    assert (again["batch_id"], again["comm"]) == (body["batch_id"], body["comm"])
    sw.close()
    assert sw._heartbeat() is None  # closed: no heartbeat
