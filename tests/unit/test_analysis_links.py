"""The link detector (``analysis/links.py``): a rank whose every data connection is slow
is named, a clean ring or one slow connection names nobody, a rank that sends far more
bytes is found; and the same on payloads recorded from real gloo ranks in network
namespaces (one veth limited by ``tc tbf`` at 150 Mbit/s, a CPU burner on every core)
and on loopback with extra traffic between two ranks."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepwatch_server.analysis import links
from stepwatch_server.analysis.arrivals import RankSteps, concat, window
from stepwatch_server.analysis.late_arrivals import ArrivalDetector
from stepwatch_server.analysis.links import LinkSample, edges, extra_bytes, merge, slow_links

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "realtrain"
MB = 1_000_000


def _ring(n: int, rates: dict[tuple[int, int], float], sent: float = 20 * MB) -> list[LinkSample]:
    """A ring all-reduce's connections, rank r sending to r-1 (as gloo's ring does), at
    ``rates`` bytes/s where given (100 MB/s elsewhere); both ends of each connection."""
    out = []
    for r in range(n):
        dst = (r - 1) % n
        rate = rates.get((r, dst), 100 * MB)
        out.append(
            LinkSample(r, 1000 + r * 10 + dst, 1000 + dst * 10 + r, int(sent), 40_000, sent / rate, 16)
        )
        out.append(LinkSample(dst, 1000 + dst * 10 + r, 1000 + r * 10 + dst, 40_000, int(sent), 0.01, 16))
    return out


def test_edges_join_both_ends_and_follow_the_data() -> None:
    es = {(e.src, e.dst): e for e in edges(_ring(4, {}))}
    assert set(es) >= {(1, 0), (2, 1), (3, 2), (0, 3)}
    assert es[(1, 0)].bytes == 20 * MB and es[(1, 0)].rate == pytest.approx(100 * MB)


def test_merge_sums_a_windows_batches() -> None:
    s = LinkSample(0, 1, 2, 10, 5, 0.5)
    (m,) = merge([s, s])
    assert (m.bytes_sent, m.bytes_received, m.busy_s) == (20, 10, 1.0)


@pytest.mark.parametrize("n", [3, 4, 8])
def test_the_rank_behind_a_slow_link_is_named(n: int) -> None:
    # Its link is slow both ways: what it sends (1 -> 0) and what it receives (2 -> 1).
    samples = _ring(n, {(1, 0): 15 * MB, (2, 1): 16 * MB})
    (x,) = slow_links(samples, step_time_s=0.4)
    assert x.rank == 1
    assert x.rate == pytest.approx(16 * MB) and x.peer_rate == pytest.approx(100 * MB)
    # 20 MB at 15 MB/s instead of 100 MB/s: 1.13 s lost over 16 steps.
    assert x.lost_s == pytest.approx((20 / 15 - 20 / 100) / 16)


def test_a_clean_ring_and_one_slow_connection_name_nobody() -> None:
    jitter = {(1, 0): 60 * MB, (2, 1): 130 * MB, (3, 2): 45 * MB}  # a loaded host's spread
    assert slow_links(_ring(4, jitter), step_time_s=0.4) == []
    # One direction only: either end could be at fault.
    assert slow_links(_ring(4, {(2, 1): 10 * MB}), step_time_s=0.4) == []


def test_a_slow_link_that_costs_nothing_is_not_named() -> None:
    samples = _ring(4, {(1, 0): 15 * MB, (2, 1): 16 * MB}, sent=0.5 * MB)
    assert slow_links(samples, step_time_s=0.4) == []  # under the data floor
    samples = _ring(4, {(1, 0): 15 * MB, (2, 1): 16 * MB}, sent=2 * MB)
    assert slow_links(samples, step_time_s=10.0) == []  # 7 ms a 10 s step


def test_extra_bytes_names_the_ranks_that_sent_more() -> None:
    samples = _ring(4, {})
    # Ranks 1 and 2 all-reduce 30 MB more on a group of their own.
    samples += [
        LinkSample(1, 7, 8, 30 * MB, 30 * MB, 0.3, 16),
        LinkSample(2, 8, 7, 30 * MB, 30 * MB, 0.3, 16),
    ]
    heavy = extra_bytes(samples)
    assert set(heavy) == {1, 2}
    assert heavy[1][0] == pytest.approx(50 * MB + 40_000)
    assert extra_bytes(_ring(4, {})) == {}


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.integers(0, 10_000), st.integers(0, 50), min_size=2, max_size=12))
def test_each_ranks_peer_median_is_the_median_of_the_others(sent: dict[int, int]) -> None:
    """The leave-one-out medians from one sort equal ``statistics.median`` of the other
    ranks' values, ties (repeated values) and odd and even counts included."""
    expected = {r: statistics.median(v for q, v in sent.items() if q != r) for r in sent}
    assert links._medians_without_each(sent) == expected


def test_a_late_rank_that_sent_more_is_named_link_not_host_stall() -> None:
    det = ArrivalDetector("r")
    extra = [LinkSample(1, 7, 8, 30 * MB, 30 * MB, 0.3, 8), LinkSample(2, 8, 7, 30 * MB, 30 * MB, 0.3, 8)]
    keys: set[str] = set()
    for w in range(3):
        first = w * 8 + 1
        ranks = [
            # Rank 1 arrives 80 ms after its peers on every step, with the same CPU.
            RankSteps(r, "h", first, [0.5] * 8, [0.0] * 8, [0.02 if r == 1 else 0.1] * 8, [0.2] * 8)
            for r in range(4)
        ]
        keys |= {f.key for f in det.update(w, [ranks], _ring(4, {}) + extra)}
    assert keys == {"straggler:link:rank=1"}
    (f,) = det.open_findings()
    assert f.cause == "link" and f.evidence["sent_mb"] > f.evidence["peer_sent_mb"]


def test_a_late_rank_without_extra_work_beside_a_slow_link_is_not_a_host_stall() -> None:
    # Rank 1's link is slow (about 71 ms lost per step); rank 3, which finishes the ring's
    # all-reduce last, starts its next step 50 ms late with the same CPU as its peers, and
    # rank 2, which sends through the slow link, 50 ms late with 40 ms more CPU: the link's
    # doing (no more than the 71 ms the link loses). Without the links both would be
    # named; a rank later than the link can explain is.
    def keys(sync_late: float, links: bool, sync_peers: float = 0.1) -> set[str]:
        det = ArrivalDetector("r")
        out: set[str] = set()
        for w in range(3):
            first = w * 8 + 1
            ranks = [
                RankSteps(
                    r,
                    "h",
                    first,
                    [0.5] * 8,
                    [0.0] * 8,
                    [sync_late if r in (2, 3) else sync_peers] * 8,
                    [0.24 if r == 2 else 0.2] * 8,
                )
                for r in range(4)
            ]
            ring = _ring(4, {(1, 0): 15 * MB, (2, 1): 16 * MB}) if links else []
            out |= {f.key for f in det.update(w, [ranks], ring)}
        return out

    assert keys(0.05, links=False) == {"straggler:host_stall:rank=3", "straggler:compute:rank=2"}
    assert keys(0.05, links=True) == {"straggler:link:rank=1"}
    # 0.4 s late per step: far more than the link loses, so still named.
    assert keys(0.05, links=True, sync_peers=0.45) >= {"straggler:link:rank=1", "straggler:compute:rank=2"}


# -- recorded from real training ---------------------------------------------------------
WINDOW = 16


def _recorded(name: str) -> tuple[list[RankSteps], list[tuple[int, LinkSample]]]:
    d = json.loads((FIXTURES / f"{name}.json").read_text())
    series, links = [], []
    for r in d["ranks"]:
        batches = r["batches"]
        series.append(
            concat(
                [
                    RankSteps(
                        r["rank"],
                        r["host"],
                        b["first"],
                        b["time_s"],
                        b["data_wait_s"],
                        b["sync_s"],
                        b["cpu_s"],
                    )
                    for b in batches
                ]
            )
        )
        for b in batches:
            last = b["first"] + len(b["time_s"]) - 1
            for x in b.get("links", []):
                links.append(
                    (
                        last,
                        LinkSample(
                            r["rank"],
                            x["local"],
                            x["peer"],
                            x["bytes"],
                            x["received"],
                            x["busy_s"],
                            len(b["time_s"]),
                        ),
                    )
                )
    return series, links


def _keys_by_window(name: str) -> list[set[str]]:
    series, links = _recorded(name)
    det = ArrivalDetector("r")
    last = min(s.first_step + len(s.sync_s) - 1 for s in series)
    out = []
    for w, w0 in enumerate(range(1, last + 1, WINDOW)):
        w1 = min(last, w0 + WINDOW - 1)
        det.update(w, [[window(s, w0, w1) for s in series]], [x for step, x in links if w0 <= step <= w1])
        out.append({f.key for f in det.open_findings()})
    return out


def test_recorded_slow_link_is_named_link_on_its_rank() -> None:
    opened = _keys_by_window("slow-link--tbf")
    assert opened[1:] and all(k == {"straggler:link:rank=1"} for k in opened[1:]), opened


def test_recorded_side_group_traffic_makes_no_slow_link() -> None:
    # Ranks 1 and 2 all-reduced 4 MiB per step on a group of their own (loopback): those
    # connections' large messages ran 5-10x "faster" than the ring's small buckets, which
    # once made the ring connections of ranks 0 and 3 look slow. Like is compared with like.
    opened = _keys_by_window("extra-comm--pair-1-2")
    assert all(not (k & {"straggler:link:rank=0", "straggler:link:rank=3"}) for k in opened), opened


def test_a_compute_stragglers_neighbour_is_not_named_for_its_link() -> None:
    """Recorded from the demo beside a CPU burner: rank 2's extra compute slowed both
    connections of rank 3, its ring neighbour, to a third of the other two in steps 49-64,
    which the link test alone names; rank 2's extra CPU per step (about 50 ms) is more
    than rank 3 lost on those connections (23-32 ms), so only rank 2 is named."""
    d = json.loads((FIXTURES / "demo-loaded-compute-neighbour.json").read_text())
    n = d["window_steps"]
    cols = ("step_time_s", "data_wait_s", "sync_s", "cpu_s", "runq_s")
    series = [RankSteps(r["rank"], "vm", r["first"], *(r[c] for c in cols)) for r in d["ranks"]]
    samples = [(row[1], LinkSample(row[0], *row[2:])) for row in d["links"]]
    det = ArrivalDetector("demo")
    opened: set[str] = set()
    link_alone: set[int] = set()
    for w, w0 in enumerate(range(1, 97, n)):
        mine = [x for step, x in samples if w0 <= step <= w0 + n - 1]
        steps = [window(s, w0, w0 + n - 1) for s in series]
        link_alone |= {x.rank for x in slow_links(mine, step_time_s=statistics.median(steps[0].step_time_s))}
        det.update(w, [steps], mine)
        opened |= {f.key for f in det.open_findings()}
    assert link_alone == {3}  # the case: the link test alone names the neighbour
    assert opened == {"straggler:compute:rank=2"}, opened
