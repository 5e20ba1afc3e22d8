"""Capture explanations: a flagged rank's profiler summary against its peers' median, on
hand-built summaries whose expected line is known (CPU ops, CUDA clocks, data wait,
collectives, missing and absent peers)."""

from __future__ import annotations

import json
from typing import Any

from stepwatch_server.analysis.captures import (
    CapturedRank,
    CollectiveTimes,
    OpTime,
    explain,
    peers_median,
)


def rank(r: int, *, mm_s: float = 0.0077, step_s: float = 0.1, **kw: Any) -> CapturedRank:
    """A captured rank of a healthy CPU job: 0.1 s steps, mostly ``aten::mm``."""
    base: dict[str, Any] = {
        "rank": r,
        "host": f"node-{r // 4}",
        "n_steps": 5,
        "skipped": None,
        "step_s": step_s,
        "compute_s": 0.07,
        "comm_overlapped_s": 0.01,
        "comm_exposed_s": 0.01,
        "data_wait_s": 0.002,
        "idle_s": 0.008,
        "top_ops": (OpTime("aten::mm", mm_s, 12.0), OpTime("aten::add_", 0.003, 40.0)),
        "device": "cpu",
    }
    base.update(kw)
    return CapturedRank(**base)


def missed(r: int, reason: str = "timed out") -> CapturedRank:
    return CapturedRank(r, None, 0, reason, None, None, None, None, None, None)


def ar(transfer: float | None, wait: float | None, count: int = 10) -> dict[str, CollectiveTimes]:
    return {"all_reduce": CollectiveTimes(count, None, wait, transfer)}


def test_slow_op_is_named_with_its_ratio() -> None:
    ranks = [rank(0), rank(1), rank(2, mm_s=0.0123), rank(3, mm_s=0.0078)]
    ex = explain(ranks, [2])
    assert ex.message.startswith("rank 2: aten::mm 1.6x its peers' median (12.3 vs 7.7 ms per step)")
    assert ex.findings[2] == ["aten::mm 1.6x its peers' median (12.3 vs 7.7 ms per step)"]
    assert "aten::add_" not in ex.message  # same as its peers
    assert ex.missed == {}


def test_power_capped_gpu_names_the_clock_and_the_cause() -> None:
    gpu: dict[str, Any] = {"device": "cuda", "sm_clock_mhz": 1980.0}
    ranks = [rank(r, **gpu) for r in range(4)]
    ranks.append(rank(4, device="cuda", sm_clock_mhz=1410.0, throttle_reasons=("sw_power_cap",)))
    ex = explain(ranks, [4])
    assert ex.message == "rank 4: SM clock 1,410 vs 1,980 MHz (power cap)"
    hot = rank(4, device="cuda", sm_clock_mhz=1410.0, throttle_reasons=("hw_thermal_slowdown",))
    assert explain([*ranks[:4], hot], [4]).findings[4] == ["SM clock 1,410 vs 1,980 MHz (thermal)"]
    # Within 5% of the peers: not a finding.
    ok = rank(4, device="cuda", sm_clock_mhz=1900.0, throttle_reasons=("sw_power_cap",))
    assert "SM clock" not in explain([*ranks[:4], ok], [4]).message
    # 6.6% below the peers, with no reason given: named, without a cause.
    low = rank(4, device="cuda", sm_clock_mhz=1850.0)
    assert explain([*ranks[:4], low], [4]).findings[4] == ["SM clock 1,850 vs 1,980 MHz"]
    slow = rank(4, device="cuda", sm_clock_mhz=1410.0, throttle_reasons=("hw_slowdown",))
    assert explain([*ranks[:4], slow], [4]).findings[4] == [
        "SM clock 1,410 vs 1,980 MHz (throttled: hw_slowdown)"
    ]


def test_data_wait_beyond_a_fifth_of_the_step() -> None:
    ranks = [rank(0), rank(1), rank(2, data_wait_s=0.045, step_s=0.143)]
    ex = explain(ranks, [2])
    assert ex.findings[2] == ["data wait 45.0 ms per step vs 2.0 ms"]
    # 15 ms extra on a 100 ms step is below the 20% bar.
    assert "data wait" not in explain([rank(0), rank(1), rank(2, data_wait_s=0.017)], [2]).message


def test_flagged_rank_that_missed_the_capture() -> None:
    ex = explain([rank(0), rank(1), missed(2, "not at a step boundary")], [2])
    assert ex.message == "rank 2: missed the capture (not at a step boundary)"
    assert ex.missed == {2: "not at a step boundary"}
    # A flagged rank with no report at all missed it too.
    assert explain([rank(0)], [7]).message == "rank 7: missed the capture (no report)"


def test_no_peer_captured() -> None:
    ex = explain([rank(2, mm_s=0.02), missed(1)], [2])
    assert ex.message == "rank 2: no peer captured to compare with"
    assert ex.missed == {1: "timed out"}


def test_all_captured_ranks_flagged_compare_with_each_other() -> None:
    ranks = [rank(0), rank(1, mm_s=0.0078), rank(2, mm_s=0.0123), missed(3)]
    ex = explain(ranks, [0, 1, 2])
    # Rank 2 against ranks 0 and 1 (median 7.75 ms); ranks 0 and 1 are not slower than their others.
    assert "rank 2: aten::mm 1.6x its peers' median (12.3 vs 7.8 ms per step)" in ex.message
    assert ex.findings[0][0].startswith("no difference found")
    assert list(ex.findings) == [0, 1, 2]


def test_transfer_normal_and_peers_waiting() -> None:
    ranks = [rank(r, collectives=ar(0.010, 0.012)) for r in range(3)]
    ranks.append(rank(3, mm_s=0.0123, collectives=ar(0.011, 0.0001)))
    ex = explain(ranks, [3])
    assert ex.findings[3] == [
        "aten::mm 1.6x its peers' median (12.3 vs 7.7 ms per step)",
        "all_reduce transfer normal",
        "its peers wait for it at all_reduce (rank 3 waits 0.1 ms, peers 12.0 ms)",
    ]
    slow_link = [*ranks[:3], rank(3, collectives=ar(0.018, 0.012))]
    assert explain(slow_link, [3]).findings[3] == ["all_reduce transfer 1.8x its peers'"]


def test_only_one_op_type_called_normal() -> None:
    coll = {
        "all_reduce": CollectiveTimes(20, None, None, 0.01),
        "broadcast": CollectiveTimes(2, None, None, 0.001),
    }
    ranks = [rank(r, collectives=coll) for r in range(3)]
    ex = explain([*ranks, rank(3, mm_s=0.0123, collectives=coll)], [3])
    assert "all_reduce transfer normal" in ex.message
    assert "broadcast transfer normal" not in ex.message


def test_nothing_found_gives_the_step_times() -> None:
    ranks = [rank(0, step_s=0.101), rank(1, step_s=0.101), rank(2, step_s=0.102)]
    assert (
        explain(ranks, [2]).message
        == "rank 2: no difference found in the captured steps (step 102.0 vs 101.0 ms)"
    )


def test_compute_slower_with_no_single_op() -> None:
    ops = tuple(OpTime(f"op{i}", 0.003, 1.0) for i in range(10))
    slower = tuple(OpTime(o.name, 0.0034, 1.0) for o in ops)  # each 1.13x: below the bar
    ranks = [rank(0, top_ops=ops), rank(1, top_ops=ops), rank(2, top_ops=slower, compute_s=0.1)]
    assert explain(ranks, [2]).findings[2] == ["compute 1.4x its peers' median (no single op stands out)"]


def test_op_only_on_the_flagged_rank() -> None:
    extra = (*rank(0).top_ops, OpTime("aten::nonzero", 0.02, 3.0), OpTime("aten::tiny", 0.001, 1.0))
    ex = explain([rank(0), rank(1), rank(2, top_ops=extra)], [2])
    assert ex.findings[2] == ["aten::nonzero only on rank 2 (20.0 ms per step)"]


def test_evidence_is_json_with_string_keys() -> None:
    ranks = [rank(0, collectives=ar(0.01, 0.01)), rank(1), rank(2, mm_s=0.0123), missed(3)]
    ev = explain(ranks, [2, 3]).to_evidence()
    back = json.loads(json.dumps(ev))
    assert back == ev
    assert set(back["per_rank"]) == {"0", "1", "2", "3"}
    assert set(back["findings"]) == {"2", "3"}
    assert back["missed"] == {"3": "timed out"}
    r0 = back["per_rank"]["0"]
    assert r0["breakdown"]["step_s"] == 0.1
    assert r0["collectives"]["all_reduce"] == {
        "count": 10,
        "duration_s": None,
        "wait_s": 0.01,
        "transfer_s": 0.01,
    }
    assert r0["top_ops"][0] == {"name": "aten::mm", "self_s": 0.0077, "count": 12.0}


def test_top_ops_in_evidence_are_at_most_five() -> None:
    ops = tuple(OpTime(f"op{i}", 0.001 * i, 1.0) for i in range(9))
    ev = explain([rank(0, top_ops=ops)], []).per_rank[0]
    assert [o["name"] for o in ev["top_ops"]] == ["op8", "op7", "op6", "op5", "op4"]


def test_message_is_capped() -> None:
    ranks = [rank(r) for r in range(40)] + [missed(r, "x" * 50) for r in range(40, 60)]
    ex = explain(ranks, list(range(40, 60)))
    assert len(ex.message) == 400
    assert ex.message.endswith("…")


def test_ranks_that_missed_do_not_enter_the_median() -> None:
    # Two healthy peers at 7.7 ms; a third "peer" that missed reports a stale 20 ms of mm.
    stale = rank(3, mm_s=0.02, n_steps=0, skipped="process exited")
    ex = explain([rank(0), rank(1), rank(2, mm_s=0.0123), stale], [2])
    assert ex.findings[2] == ["aten::mm 1.6x its peers' median (12.3 vs 7.7 ms per step)"]
    assert ex.missed == {3: "process exited"}


def test_peers_median_ignores_unknowns() -> None:
    assert peers_median([None, 3.0, 1.0, None, 2.0]) == 2.0
    assert peers_median([None, None]) is None
    assert peers_median([]) is None


def test_communication_ops_are_left_to_the_collectives() -> None:
    """A straggler's gloo all-reduce *call* is longer on CPU (measured on real training:
    c10d::allreduce_ 3.5x its peers'): that is not where its time went."""
    ops_f = (OpTime("aten::tanh", 0.028, 4.0), OpTime("c10d::allreduce_", 0.020, 1.0))
    ops_p = (OpTime("c10d::allreduce_", 0.006, 1.0),)
    f = CapturedRank(2, "h", 4, None, 0.5, 0.4, 0.0, 0.05, 0.0, 0.05, top_ops=ops_f)
    peers = [CapturedRank(r, "h", 4, None, 0.5, 0.3, 0.0, 0.15, 0.0, 0.05, top_ops=ops_p) for r in (0, 1, 3)]
    e = explain([f, *peers], [2])
    assert "allreduce_" not in e.message and "aten::tanh only on rank 2" in e.message, e.message
