"""The retry policy shared by the agent's sender and the webhook (stepwatch.retry)."""

from __future__ import annotations

import pytest

from stepwatch.retry import Verdict, full_jitter, retry_after_s, verdict


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (200, Verdict.DONE),
        (204, Verdict.DONE),
        (None, Verdict.WAIT),  # no answer: the collector is away
        (503, Verdict.WAIT),
        (502, Verdict.WAIT),
        (504, Verdict.WAIT),
        (429, Verdict.WAIT),
        (408, Verdict.WAIT),
        (425, Verdict.WAIT),
        (500, Verdict.RETRY),  # failed on this request: bounded
        (507, Verdict.RETRY),
        (400, Verdict.REFUSED),
        (401, Verdict.REFUSED),
        (403, Verdict.REFUSED),
        (413, Verdict.REFUSED),
        (422, Verdict.REFUSED),
        (308, Verdict.REFUSED),  # redirects are not followed
    ],
)
def test_verdict(status: int | None, expected: Verdict) -> None:
    assert verdict(status) is expected


def test_full_jitter_spans_zero_to_the_capped_exponential() -> None:
    assert [full_jitter(n, 0.5, 30.0, rand=lambda: 1.0) for n in (1, 2, 3, 7, 8, 500)] == [
        0.5,
        1.0,
        2.0,
        30.0,
        30.0,
        30.0,
    ]
    assert full_jitter(5, 0.5, 30.0, rand=lambda: 0.0) == 0.0
    assert full_jitter(3, 0.5, 30.0, rand=lambda: 0.25) == 0.5


def test_retry_after_reads_seconds_and_http_dates_within_the_cap() -> None:
    now = 1_700_000_000.0  # Tue, 14 Nov 2023 22:13:20 GMT
    assert retry_after_s("5") == 5.0
    assert retry_after_s(" 2.5 ") == 2.5
    assert retry_after_s("3600") == 60.0
    assert retry_after_s("3600", cap_s=7200) == 3600.0
    assert retry_after_s("-3") == 0.0
    assert retry_after_s("Tue, 14 Nov 2023 22:13:50 GMT", now=now) == 30.0
    assert retry_after_s("Tue, 14 Nov 2023 22:00:00 GMT", now=now) == 0.0  # in the past
    for unreadable in (None, "", "soon", "nan", "Tue, 14 Nov 2023 22:13:50 -0000"):
        assert retry_after_s(unreadable, now=now) is None, unreadable
