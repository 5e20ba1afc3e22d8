"""The collector's window size, chosen once from a run's first batch."""

from __future__ import annotations

from stepwatch_server.ingest.store import choose_window_steps


def test_a_power_of_two_near_the_window_seconds() -> None:
    assert choose_window_steps([0.5] * 4, 8.0) == 16
    assert choose_window_steps([0.3] * 4, 8.0) == 32
    assert choose_window_steps([], 8.0) == 1


def test_the_first_step_and_tagged_steps_are_left_out_when_the_batch_has_others() -> None:
    # Step 1 carries the set-up (4 s here against 0.5 s steps), step 2 is a slow warm-up
    # step: the pace is the untagged steps'. The same times later in a run, untagged, are
    # all the pace there is (median 1.75 s: 4-step windows).
    times, tags = [4.0, 3.0, 0.5, 0.5], ["warmup", "warmup", None, None]
    assert choose_window_steps(times, 8.0, first=1, tags=tags) == 16
    assert choose_window_steps(times, 8.0, first=40) == 4
    # Only warm-up steps: the later ones still say more than the first.
    assert choose_window_steps([4.0, 1.0, 1.0], 8.0, first=1, tags=["warmup"] * 3) == 8
    # A batch of a later part of the run: its first step is no set-up.
    assert choose_window_steps([1.0, 0.5, 0.5], 8.0, first=40) == 16
    # Step 1 alone is all there is.
    assert choose_window_steps([4.0], 8.0, first=1) == 2
