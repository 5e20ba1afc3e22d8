"""The agent's run plan, its final batch, and the optional payload sections."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest

import stepwatch
from stepwatch import _agent
from stepwatch._env import detect
from stepwatch._payload import build_payload, plan_section
from stepwatch._sender import MemorySink
from stepwatch._window import Window
from stepwatch.config import AgentConfig

from .test_agent import FakeClock


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    c = FakeClock()
    monkeypatch.setattr(_agent, "_perf", c)
    return c


def make_agent(sender: MemorySink, plan: dict[str, object] | None = None) -> stepwatch.Stepwatch:
    cfg = AgentConfig(run="r", max_window_steps=8, send_interval_s=1e9, warmup_steps=0)
    return stepwatch.Stepwatch(cfg, detect({}, host="h"), convention=None, sender=sender, plan=plan)


def _payload(sw: stepwatch.Stepwatch, window: Window) -> dict[str, object]:
    return json.loads(sw._encode(window, MemorySink().stats))  # type: ignore[no-any-return]


def test_close_marks_the_last_window_final(clock: FakeClock) -> None:
    sender = MemorySink()
    sw = make_agent(sender)
    for _ in range(3):
        clock.t += 0.1
        sw.step(tokens=5)
    sw.close()
    (w,) = sender.windows
    assert (w.n_steps, w.final) == (3, True)
    assert _payload(sw, w)["final"] is True


def test_a_final_window_may_be_empty_but_only_after_some_step(clock: FakeClock) -> None:
    sender = MemorySink()
    sw = make_agent(sender)
    for _ in range(8):  # exactly one full window: nothing left open at close
        clock.t += 0.1
        sw.step(tokens=5)
    sw.close()
    assert [(w.n_steps, w.final) for w in sender.windows] == [(8, False), (0, True)]
    body = _payload(sw, sender.windows[1])
    assert body["steps"]["time_s"] == [] and body["steps"]["first"] == 9  # type: ignore[index]
    idle = MemorySink()
    make_agent(idle).close()
    assert idle.windows == []  # never stepped: nothing to finish


def test_plan_travels_with_every_batch_and_sections_are_left_out_when_empty(clock: FakeClock) -> None:
    sender = MemorySink()
    plan = plan_section(target_tokens=10**12, config_fingerprint="cfg-1")
    sw = make_agent(sender, plan)
    clock.t += 0.1
    sw.step(tokens=5)
    sw.flush()
    body = _payload(sw, sender.windows[0])
    assert body["plan"] == {"target_tokens": 10**12, "config_fingerprint": "cfg-1"}
    assert "final" not in body and "profiles" not in body
    bare = build_payload(
        sender.windows[0], run="r", rank={}, convention=None, agent={}, sent_at=1.0, plan=None, profiles=None
    )
    assert set(bare) == {
        "schema_version",
        "batch_id",
        "run",
        "sent_at",
        "agent",
        "rank",
        "convention",
        "steps",
    }
    sw.close()


def test_init_validates_the_plan() -> None:
    when = datetime.now(timezone.utc) + timedelta(days=76)
    sw = stepwatch.init(
        run="plan-run",
        url="http://127.0.0.1:9",
        target_tokens=2 * 10**12,
        deadline=when,
        config_fingerprint="llama8b/seq4096/bf16",
        baseline_run="llama-8b-v1",
        flops_per_token=1.0,
        flush_timeout_s=0.1,
    )
    try:
        assert sw.plan == {
            "target_tokens": 2 * 10**12,
            "deadline": when.timestamp(),
            "config_fingerprint": "llama8b/seq4096/bf16",
            "baseline_run": "llama-8b-v1",
        }
    finally:
        sw.close(timeout_s=0.1)
    for kwargs, match in (
        ({"target_tokens": 0}, "target_tokens"),
        ({"deadline": datetime(2030, 1, 1)}, "timezone-aware"),
        ({"deadline": -5.0}, "Unix seconds"),
        ({"config_fingerprint": "has space"}, "config_fingerprint"),
        ({"baseline_run": "bad name!"}, "baseline_run"),
    ):
        with pytest.raises(ValueError, match=match):
            stepwatch.init(run="plan-run", url="http://127.0.0.1:9", flops_per_token=1.0, **kwargs)  # type: ignore[arg-type]
