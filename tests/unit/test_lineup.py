"""Wait vs transfer across the ranks of a group (pure function)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepwatch.profiler.lineup import GroupArrivals, split_wait_transfer


def _g(enter: list[float], end: list[float], *, step: list[int] | None = None, **kw: object) -> GroupArrivals:
    n = len(enter)
    args: dict[str, object] = {
        "group": "0",
        "ranks": (0, 1, 2),
        "size": 3,
        "key_kind": "order",
        "step": step or [1] * n,
        "op": ["all_reduce"] * n,
        "key": list(range(n)),
        "enter": enter,
        "end": end,
    }
    args.update(kw)
    return GroupArrivals(**args)  # type: ignore[arg-type]


def test_the_last_arrival_waits_nothing_and_its_peers_wait_for_it() -> None:
    """Rank 2 is a compute straggler: it enters the all-reduce 50 ms late."""
    out = split_wait_transfer(
        {0: [_g([1.000], [1.060])], 1: [_g([1.005], [1.060])], 2: [_g([1.050], [1.061])]}, world_size=3
    )
    assert out[2].steps[1] == pytest.approx([0.0, 0.011, 1])
    assert out[0].steps[1] == pytest.approx([0.050, 0.010, 1])
    assert out[1].steps[1] == pytest.approx([0.045, 0.010, 1])
    assert out[0].ops["all_reduce"] == ([pytest.approx(0.05)], [pytest.approx(0.01)])


def test_clock_offsets_are_applied_before_comparing() -> None:
    """Rank 1's clock runs 2 s behind rank 0's: its offset is +2 s."""
    out = split_wait_transfer(
        {0: [_g([10.0], [10.5], ranks=(0, 1), size=2)], 1: [_g([8.2], [8.5], ranks=(0, 1), size=2)]},
        world_size=2,
        offsets={1: 2.0},
    )
    assert out[0].steps[1][0] == pytest.approx(0.2) and out[1].steps[1][0] == 0.0


def test_incomplete_collectives_are_left_out() -> None:
    """Rank 2 reported only the first of two collectives: the second has no known last arrival."""
    out = split_wait_transfer(
        {
            0: [_g([1.0, 2.0], [1.5, 2.5])],
            1: [_g([1.1, 2.1], [1.5, 2.5])],
            2: [_g([1.2], [1.5])],
        },
        world_size=3,
    )
    assert all(out[r].steps[1][2] == 1 for r in range(3))
    assert out[0].ops["all_reduce"][0] == [pytest.approx(0.2)]


def test_sequence_keys_line_up_across_steps_and_groups_stay_apart() -> None:
    seq = {"key_kind": "seq", "ranks": (0, 1), "size": 2}
    out = split_wait_transfer(
        {
            0: [_g([1.0], [1.2], key=[41], **seq), _g([1.0], [1.1], group="tp", key=[7], **seq)],
            1: [_g([1.1], [1.2], key=[41], **seq), _g([1.05], [1.1], group="tp", key=[7], **seq)],
        },
        world_size=2,
    )
    assert out[0].steps[1][0] == pytest.approx(0.1 + 0.05)
    assert out[1].steps[1][0] == pytest.approx(0.0)


def test_a_group_without_member_list_is_the_whole_world() -> None:
    out = split_wait_transfer(
        {r: [_g([1.0 + r / 10], [2.0], ranks=None, size=None)] for r in range(4)}, world_size=4
    )
    assert sorted(round(out[r].steps[1][0], 6) for r in range(4)) == [0.0, 0.1, 0.2, 0.3]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0, 10), st.floats(0, 1)),  # (enter, transfer after the last arrival)
        min_size=2,
        max_size=6,
    )
)
def test_wait_plus_transfer_is_the_duration_and_exactly_the_last_arrival_waits_nothing(
    ranks: list[tuple[float, float]],
) -> None:
    last = max(e for e, _ in ranks)
    members = tuple(range(len(ranks)))
    arrivals = {
        r: [_g([enter], [last + tail], ranks=members, size=len(ranks))]
        for r, (enter, tail) in enumerate(ranks)
    }
    out = split_wait_transfer(arrivals, world_size=len(ranks))
    for r, (enter, tail) in enumerate(ranks):
        wait, transfer, n = out[r].steps[1]
        assert n == 1 and wait >= 0 and transfer >= 0
        assert wait + transfer == pytest.approx(last + tail - enter, abs=1e-9)
        assert (wait == 0) == (enter == last)
