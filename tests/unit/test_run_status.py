"""Run status from plain values: the one rule that the API, page, top and /metrics share."""

from __future__ import annotations

import pytest

from stepwatch_server.reads.status import DEFAULT_RULE, StatusRule, classify

NOW = 1_000_000.0


@pytest.mark.parametrize(
    ("finished", "hang", "silent_s", "step_s", "expected"),
    [
        (2, False, 5.0, 0.5, "finished"),
        (2, True, 500.0, 0.5, "finished"),  # finished wins over a hang the next pass closes
        (1, True, 5.0, 0.5, "hung"),
        (1, False, 61.0, 0.5, "stalled"),  # the 60 s floor
        (0, False, 59.0, 0.5, "live"),
        (0, False, 90.0, 10.0, "live"),  # 10 x a 10 s step is 100 s
        (0, False, 101.0, 10.0, "stalled"),
        (0, False, 61.0, None, "live"),  # the startup allowance while no step time is known
        (0, False, 601.0, None, "stalled"),
    ],
)
def test_classify(finished: int, hang: bool, silent_s: float, step_s: float | None, expected: str) -> None:
    got = classify(
        world_size=2,
        ranks_finished=finished,
        open_hang=hang,
        last_seen=NOW - silent_s,
        step_time_s=step_s,
        now=NOW,
        rule=DEFAULT_RULE,
    )
    assert got == expected


def test_the_rule_follows_the_hang_settings() -> None:
    kw = {"world_size": 1, "ranks_finished": 0, "open_hang": False, "last_seen": NOW - 30, "now": NOW}
    assert classify(**kw, step_time_s=1.0, rule=StatusRule(k=10, floor_s=20)) == "stalled"  # type: ignore[arg-type]
    assert classify(**kw, step_time_s=1.0, rule=StatusRule(k=10, floor_s=60)) == "live"  # type: ignore[arg-type]
    assert classify(**{**kw, "last_seen": None}, step_time_s=None, rule=DEFAULT_RULE) == "stalled"  # type: ignore[arg-type]
