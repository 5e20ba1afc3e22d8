"""The agent's side of steering: directives parsed from an ingest answer on the sender
thread are applied at the next window close, each once, and acknowledged; a capture runs
the real torch.profiler over exactly the steps asked for, with the periodic window off."""

from __future__ import annotations

import gzip
import json
from typing import Any

import pytest
import torch

import stepwatch
from stepwatch._env import detect
from stepwatch._sender import MemorySink
from stepwatch._steering import Steering
from stepwatch.config import AgentConfig
from stepwatch.profiler import _window
from stepwatch.profiler._window import AST_THREAD_SAFE, ProfilerWindow


def _answer(*directives: dict[str, Any]) -> bytes:
    return json.dumps({"batch_id": "x", "stored": True, "steps": 8, "directives": list(directives)}).encode()


def _agent(every: int = 0) -> tuple[stepwatch.Stepwatch, ProfilerWindow, MemorySink]:
    cfg = AgentConfig(run="steer", max_window_steps=8, send_interval_s=1e9, warmup_steps=0)
    pw = ProfilerWindow(every=every, steps=2, budget=1e9, warmup_end=0)  # no stretch: exact steps
    sink = MemorySink()
    sw = stepwatch.Stepwatch(cfg, detect({}, host="h"), convention=None, sender=sink, profiler=pw)
    return sw, pw, sink


def _train(sw: stepwatch.Stepwatch, steps: int) -> None:
    a = torch.randn(64, 64)
    for _ in range(steps):
        a = torch.tanh(a @ a)
        sw.step(tokens=10)


def test_a_capture_profiles_exactly_the_steps_asked_for_with_the_periodic_window_off() -> None:
    sw, pw, _ = _agent(every=0)
    trace = {"trace_ranks": [0], "trace_max_bytes": 1 << 24}  # this rank is asked for its raw trace
    sw._on_answer(_answer({"id": "7", "kind": "capture", "first_step": 12, "steps": 3, **trace}))
    _train(sw, 7)
    assert sw._steering.inbox, "nothing applied before the window closes"
    _train(sw, 1)  # step 8 closes the first window: the directive is applied there
    assert sw._steering.take_acks() == [{"id": "7", "state": "scheduled"}]
    _train(sw, 24)
    assert sw.flush(30.0)
    (entry,) = pw.take()
    assert (entry["capture"], entry["first_step"], entry["n_steps"]) == ("7", 12, 3)
    assert entry["top_ops"] and entry["cost"]["every"] == 0  # asked for, not periodic
    assert pw.captures == 1 and pw.windows == 0
    assert (pw.warm_cpu_s is not None) == AST_THREAD_SAFE  # readied on receipt where safe
    ((capture, packed),) = pw.traces
    assert capture == "7" and "ProfilerStep#12" in gzip.decompress(packed).decode()
    sw.close(1.0)


def test_one_time_imports_stay_on_the_calling_thread_where_asts_are_not_thread_safe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CPython before 3.11.8 / 3.12.2 (gh-106905): a background import of torch._inductor
    can make the training thread's ``ast.parse`` raise, so nothing is imported off it."""
    monkeypatch.setattr(_window, "AST_THREAD_SAFE", False)
    pw = ProfilerWindow(every=0, steps=2, budget=1e9, warmup_end=0)
    pw.warm(background_only=True)  # the sender thread, when a capture arrives
    assert pw.warm_cpu_s is None and pw._thread is None
    pw.warm()  # init, on the training thread before the first step
    assert pw.warm_cpu_s is not None and pw._thread is None


def test_a_directive_is_applied_once_acknowledged_again_and_never_raises() -> None:
    sw, _, _ = _agent(every=0)
    st = sw._steering
    late = {"id": "1", "kind": "capture", "first_step": 3, "steps": 2}
    st.receive(_answer(late, {"id": "bad id!", "kind": "capture"}, {"id": "2", "kind": "reboot"}))
    assert st.ignored == 2
    _train(sw, 8)
    (ack,) = st.take_acks()
    assert ack["id"] == "1" and ack["state"] == "missed" and "too late" in ack["reason"]
    st.receive(_answer(late))  # the collector did not get the ack: it is sent again, not reapplied
    assert not st.inbox and st.take_acks() == [ack]
    st.receive(_answer({"id": "3", "kind": "capture", "first_step": "soon", "steps": 2}))
    _train(sw, 8)
    assert st.take_acks()[0]["state"] == "missed"
    st.receive(b"not json")  # a broken answer is ignored
    st.receive(_answer({"id": "4", "v": 2, "kind": "config", "settings": {"send_interval_s": 2}}))
    (newer,) = st.take_acks()
    assert newer["state"] == "refused" and "version 2 is newer than this agent's (1)" in newer["reason"]
    assert not st.inbox
    sw.close(1.0)


def test_live_settings_change_the_send_interval_and_the_profiler_at_the_next_window() -> None:
    sw, pw, sink = _agent(every=0)
    st = sw._steering
    settings = {"send_interval_s": 2.5, "profile_every": 6}
    st.receive(_answer({"id": "9", "kind": "config", "settings": settings}))
    st.receive(_answer({"id": "10", "kind": "config", "settings": {"send_interval_s": 0.001}}))
    st.receive(_answer({"id": "11", "kind": "config", "settings": {"profile_steps": 2, "profile_every": 2}}))
    _train(sw, 8)
    applied, refused, bad = st.take_acks()
    assert applied == {
        "id": "9",
        "state": "applied",
        "settings": {"send_interval_s": 2.5, "profile_every": 6, "profile_steps": 2},
    }
    assert refused["state"] == "refused" and "outside [0.5, 3600]" in refused["reason"]
    assert bad["state"] == "refused" and "larger than profile_steps" in bad["reason"]
    assert sw._interval == 2.5 and (pw.base, pw.k) == (6, 2)
    _train(sw, 16)  # the periodic window now runs every 6 steps: steps 13-14, then 19-20
    assert sw.flush(30.0)
    # (the second may be skipped, with its reason, while the first is still being parsed)
    entries = sorted(pw.take(), key=lambda e: e["first_step"])
    assert [e["first_step"] for e in entries][:2] == [13, 19] and entries[0]["n_steps"] == 2, entries
    # Every batch says which configs this process applied or refused, so that the
    # collector sends them again to a restarted rank (whose list starts empty).
    body = json.loads(sw._encode(sink.windows[-1], sink.stats))
    assert body["agent"]["configs"] == ["9", "10", "11"]
    sw.close(1.0)


def test_the_inbox_and_the_acks_are_bounded() -> None:
    st = Steering()
    for i in range(200):
        st.receive(_answer(*({"id": f"{i}-{j}", "kind": "config", "settings": {}} for j in range(8))))
    assert len(st.inbox) <= 32
    for _ in range(200):
        st.ack("x", "refused", "r")
    assert len(st.take_acks()) == 16


class _Failing:
    def start(self) -> None:
        raise RuntimeError("CUPTI busy")

    step_num = 0


def test_captures_queue_in_step_order_and_one_that_cannot_start_answers_for_itself() -> None:
    sw, pw, _ = _agent(every=0)
    st = sw._steering
    st.receive(
        _answer(
            {"id": "b", "kind": "capture", "first_step": 20, "steps": 2},
            {"id": "a", "kind": "capture", "first_step": 12, "steps": 2},
            {"id": "c", "kind": "capture", "first_step": 21, "steps": 2},  # overlaps b
        )
    )
    _train(sw, 8)
    acks = {a["id"]: a for a in st.take_acks()}
    assert (acks["a"]["state"], acks["b"]["state"]) == ("scheduled", "scheduled")
    assert acks["c"]["state"] == "missed" and "overlaps capture b (steps 20-21)" in acks["c"]["reason"]
    _train(sw, 8)  # a: steps 12-13 with the real profiler
    assert sw.flush(30.0)
    pw._make = _Failing  # capture b's profiler will not start (edge at step 19)
    _train(sw, 8)
    assert sw.flush(30.0)
    by_id = {e["capture"]: e for e in pw.take()}
    assert by_id["a"]["first_step"] == 12 and by_id["a"]["n_steps"] == 2
    assert by_id["b"]["n_steps"] == 0 and "CUPTI busy" in by_id["b"]["skipped"], by_id["b"]
    sw.close(1.0)
