"""The trace parser and ``stepwatch trace`` on real GPU traces (HolisticTraceAnalysis' test
data, MIT, in tests/fixtures/hta; stepwatch's GPU check on an H200, in tests/fixtures/h200):
what a user with traces from a real job gets.

The figures pinned here were read off these files by hand-checked runs of the parser; a
change of the classification or of the step attribution moves them and fails the test.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path

import pytest

from stepwatch.profiler.breakdown import total, union
from stepwatch.profiler.chrome import load_chrome_trace
from stepwatch.profiler.report import analyse, render
from stepwatch.profiler.trace import parse_chrome_trace, window_breakdown

HTA = Path(__file__).resolve().parents[1] / "fixtures" / "hta"
H200 = Path(__file__).resolve().parents[1] / "fixtures" / "h200"


@pytest.mark.parametrize(("name", "rel"), [("first_step_2048", 0.04), ("first_step_4096", 0.01)])
def test_an_h200_windows_steps_match_its_cuda_events(name: str, rel: float) -> None:
    """Every step of the window, the first included, as the CUDA events recorded at its
    boundaries measured it. The profiler's start (2.6-2.8 ms of CUPTI buffer requests
    holding the training thread) is no step's: counted in, the first step read 5.41 ms
    against the events' 2.38 (2048²) and 19.1 against 16.26 (4096²)."""
    w = parse_chrome_trace(load_chrome_trace(H200 / f"{name}.json.gz"))
    events = json.loads((H200 / f"{name}.events.json").read_text())["events_s"]
    steps = [b.step_s for b in window_breakdown(w)]
    assert w.device == "cuda" and len(steps) == 7  # the 7th: after the last step, before stop
    for i, (got, want) in enumerate(zip(steps, events, strict=False)):
        assert got == pytest.approx(want, rel=rel), f"step {i}"
    # The device had drained the step before the window by its first launch.
    assert w.before_window_us == 0.0


def test_work_launched_before_the_window_stays_out_of_the_first_step() -> None:
    w = parse_chrome_trace(load_chrome_trace(HTA / "negative_queue_length_values_check" / "rank0.json.gz"))
    steps = [b.step_s * 1e3 for b in window_breakdown(w)]
    assert w.device == "cuda" and len(steps) == 5
    # 59.5 ms of GPU work launched before the window: in the first step it read 371.6 ms.
    assert w.before_window_us / 1e3 == pytest.approx(59.5, abs=0.1)
    assert steps[0] == pytest.approx(statistics.median(steps[1:]), rel=0.02)
    busy = total(union(w.compute, w.comm, w.copies))
    assert total(w.comm) / busy == pytest.approx(0.4285, abs=0.002)
    ops = Counter(r.op for r in w.collectives)
    assert ops == {"all_to_all": 45, "reduce_scatter": 10, "all_reduce": 10, "all_gather": 10, "send_recv": 5}


def test_two_ranks_of_a_real_job_are_broken_down_and_their_collectives_lined_up() -> None:
    report = analyse([HTA / "trace_filter"])
    assert [(r.rank, r.world_size, r.device, len(r.steps)) for r in report.ranks] == [
        (0, 128, "cuda", 2),
        (1, 128, "cuda", 2),
    ]
    for r in report.ranks:
        for s in r.steps:  # the parts of the step (communication hidden and exposed) add up
            parts = sum(
                s[k]
                for k in (
                    "compute_s",
                    "copy_s",
                    "comm_overlapped_s",
                    "comm_exposed_s",
                    "data_wait_s",
                    "idle_s",
                )
            )
            assert parts == pytest.approx(s["time_s"], rel=1e-4)
    assert report.unmatched == 0
    ops0, ops1 = report.lineup[0]["ops"], report.lineup[1]["ops"]
    assert {op: v["count"] for op, v in ops0.items()} == {"all_gather": 2, "all_reduce": 4, "all_to_all": 4}
    # Rank 1 is the last to arrive at every all-reduce: it waits for nobody, rank 0 for it.
    assert ops1["all_reduce"]["wait_s"] == 0.0
    assert ops0["all_reduce"]["wait_s"] == pytest.approx(0.1898, abs=0.001)
    text = render(report)
    assert "rank 0 of 128" in text and "collectives lined up across ranks 0, 1" in text
