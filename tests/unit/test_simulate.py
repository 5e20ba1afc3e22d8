"""The simulator's topology, fault syntax and timing model (pure; no HTTP here)."""

from __future__ import annotations

import json

import pytest

from stepwatch._env import coords_for
from stepwatch.profiler.lineup import GroupArrivals, split_wait_transfer
from stepwatch.simulate import Fault, Noise, TimingModel, Topology, parse_fault
from stepwatch.simulate.entries import profile_entries
from stepwatch.simulate.model import RankTiming
from stepwatch_server.schemas import ProfileIn

THREE_D = Topology(hosts=4, ranks_per_host=8, tp=4, pp=2)  # dp 4


def test_topology_matches_what_the_agent_reads_from_a_launcher() -> None:
    topo = THREE_D
    assert (topo.world, topo.dp) == (32, 4)
    for r in (0, 5, 17, 31):
        assert topo.coords[r] == coords_for(r, topo.layout)
        info = topo.rank_info(r)
        assert info["host"] == f"sim-n{r // 8:04d}" and info["local_rank"] == r % 8
        assert info["counts_tokens"] == (topo.coords[r]["tp"] == 0 and topo.coords[r]["pp"] == 0)
    # Every rank is in exactly one group of each type; a group agrees on all other coordinates.
    assert topo.group_types == ("dp", "tp", "pp")
    for (gtype, _), members in topo.groups.items():
        others = [d for d in ("dp", "tp", "cp", "pp") if d != gtype]
        assert len({tuple(topo.coords[r][d] for d in others) for r in members}) == 1
    assert sorted(len(m) for (t, _), m in topo.groups.items() if t == "tp") == [4] * 8
    assert Topology(hosts=2, ranks_per_host=8).group_types == ()  # pure data parallel
    with pytest.raises(ValueError, match="divisible"):
        Topology(hosts=1, ranks_per_host=6, tp=4)


@pytest.mark.parametrize(
    ("spec", "fault"),
    [
        ("compute:rank=13,at=20", Fault("compute", at=20, target=13, mag=0.2)),
        ("link:rank=7,at=3,mag=1.0,until=9", Fault("link", at=3, target=7, mag=1.0, until=9)),
        ("host:host=2,at=5,mag=0.3", Fault("host", at=5, target=2, mag=0.3)),
        ("mfu:at=200,mag=0.05,component=compute_s", Fault("mfu", at=200, mag=0.05, component="compute_s")),
        ("HANG:rank=3,at=8", Fault("hang", at=8, target=3)),
    ],
)
def test_fault_specs_parse_and_print_back(spec: str, fault: Fault) -> None:
    parsed = parse_fault(spec)
    assert parsed == fault
    assert parse_fault(parsed.spec) == parsed


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("meteor:rank=1", "unknown fault"),
        ("compute:rank", "key=value"),
        ("compute:rank=1,speed=2", "unknown key"),
        ("compute:rank=x", "bad fault"),
        ("mfu:at=3,mag=1.5", "fraction"),
        ("data:rank=1,at=5,until=5", "at < until"),
    ],
)
def test_bad_fault_specs_say_what_is_wrong(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_fault(spec)


def test_clean_windows_carry_tags_noise_and_a_consistent_breakdown() -> None:
    noise = Noise(warmup_steps=20, checkpoint_every=48, eval_every=64, eval_steps=4)
    model = TimingModel(THREE_D, step_time_s=2.0, steps_per_window=16, noise=noise, seed=3)
    windows = list(model.windows(8))
    assert [w.first_step for w in windows] == [1 + 16 * i for i in range(8)]
    tags = [t for w in windows for t in w.tags]
    assert tags[:20] == ["warmup"] * 20 and tags[20] is None
    assert tags[47] == "checkpoint" and tags[60:64] == ["eval"] * 4
    steps = [t for w in windows for t in w.step_time_s]
    assert steps[47] > steps[46] + 25  # the checkpoint pause
    clean = [t for t, tag in zip(steps, tags, strict=True) if tag is None]
    assert 1.7 < sum(clean) / len(clean) < 2.3  # about the nominal step time
    w = windows[5]
    for r, t in enumerate(w.ranks):
        # The parts add up to the window's step time (before tagged pauses).
        total = t.compute_s + t.comm_overlapped_s + t.data_wait_s + t.comm_exposed_s + t.idle_s
        assert total == pytest.approx(
            max(x.compute_s + x.comm_overlapped_s + x.data_wait_s + x.comm_exposed_s for x in w.ranks),
            rel=0.02,
        )
        assert t.comm_wait_s >= 0 and set(t.group_transfer_s) == {"dp", "tp", "pp"}
        assert sum(w.data_wait_s[r]) / w.n_steps == pytest.approx(t.data_wait_s)
    # The last pipeline stage computes longer by design.
    last_stage = [t.compute_s for r, t in enumerate(w.ranks) if THREE_D.coords[r]["pp"] == 1]
    first_stage = [t.compute_s for r, t in enumerate(w.ranks) if THREE_D.coords[r]["pp"] == 0]
    assert min(last_stage) > max(first_stage)
    # Seeded: the same seed gives the same numbers.
    again = list(TimingModel(THREE_D, steps_per_window=16, noise=noise, seed=3).windows(8))
    assert again[5].ranks == w.ranks and again[5].step_time_s == w.step_time_s


@pytest.mark.parametrize("topo", [THREE_D, Topology(hosts=2, ranks_per_host=4)], ids=["3d", "dp"])
def test_profile_entries_are_valid_payload_entries_whose_arrivals_give_the_models_wait(
    topo: Topology,
) -> None:
    """The entries pass the collector's schema, and the collector's own wait/transfer split
    of their arrival times gives back the model's wait, transfer and per-type transfer
    (as shares of the step: the entry scales the window means to each profiled step)."""
    faults = [Fault("compute", at=0, target=5, mag=0.3), Fault("link", at=0, target=2, mag=1.0)]
    model = TimingModel(topo, steps_per_window=16, faults=faults, seed=4)
    wt = list(model.windows(3))[2]
    entries = profile_entries(model, wt, t0=1.7e9)
    assert sorted(entries) == list(range(topo.world))
    arrivals = {}
    for r, e in entries.items():
        p = ProfileIn.model_validate_json(json.dumps(e))
        assert (p.first_step, p.n_steps, p.time_s) == (wt.first_step, 16, wt.step_time_s)
        arrivals[r] = [
            GroupArrivals(
                group=g.group,
                ranks=tuple(g.ranks) if g.ranks else None,
                size=g.size,
                key_kind=g.key_kind,
                step=g.step,
                op=g.op,
                key=g.key,
                enter=[p.t0 + x for x in g.enter],  # type: ignore[operator]
                end=[p.t0 + x for x in g.end],  # type: ignore[operator]
            )
            for g in p.arrivals
        ]
    split = split_wait_transfer(arrivals, world_size=topo.world)
    time_sum = sum(wt.step_time_s)
    for r, t in enumerate(wt.ranks):
        step = t.compute_s + t.comm_overlapped_s + t.comm_exposed_s + t.data_wait_s + t.idle_s
        wait = sum(v[0] for v in split[r].steps.values())
        transfer = sum(v[1] for v in split[r].steps.values())
        assert wait / time_sum == pytest.approx(t.comm_wait_s / step, abs=1e-6)
        assert transfer / time_sum == pytest.approx(t.comm_transfer_s / step, rel=1e-6)
    # The straggler waits for nobody; its data-parallel peers wait for it.
    peers = next(m for m in topo.dp_groups.values() if 5 in m)
    assert wt.ranks[5].comm_wait_s < min(wt.ranks[r].comm_wait_s for r in peers if r != 5)


def test_compute_straggler_computes_longer_and_waits_less() -> None:
    topo = Topology(hosts=2, ranks_per_host=8)
    model = TimingModel(topo, faults=[parse_fault("compute:rank=5,at=2,mag=0.3")], seed=1)
    w0, _, w2 = list(model.windows(3))
    others = [t for r, t in enumerate(w2.ranks) if r != 5]
    assert w2.ranks[5].compute_s > 1.25 * max(t.compute_s for t in others)
    assert w2.ranks[5].comm_wait_s == pytest.approx(0.0, abs=1e-9)  # everyone waits for it
    # ...and every other rank waits at least the straggler's lead over it.
    mine = w2.ranks[5]

    def arrival(t: RankTiming) -> float:  # compute, the overlapped part included, then the loader
        return t.compute_s + t.comm_overlapped_s + t.data_wait_s

    lead = arrival(mine) - max(arrival(t) for t in others)
    assert min(t.comm_wait_s for t in others) == pytest.approx(lead)
    assert w0.ranks[5].compute_s < 1.1 * max(t.compute_s for t in w0.ranks)  # not before the fault


def test_link_fault_slows_every_group_of_the_rank() -> None:
    model = TimingModel(THREE_D, faults=[parse_fault("link:rank=21,at=1,mag=0.5")], seed=2)
    _, w = list(model.windows(2))
    mine = w.ranks[21].group_transfer_s
    for gtype in ("dp", "tp", "pp"):
        gid = THREE_D.group_id(21, gtype)
        outside = [w.ranks[r].group_transfer_s[gtype] for r in range(32) if THREE_D.group_id(r, gtype) != gid]
        assert mine[gtype] > 1.3 * max(outside)


def test_mfu_drop_lengthens_the_step_by_exactly_one_over_one_minus_the_drop() -> None:
    noise = Noise(step_jitter=0.0, rank_spread=0.0, gc_prob=0.0, gc_every=0, data_jitter=0.0, stall_prob=0.0)
    noise = Noise(
        **{**noise.__dict__, "transfer_jitter": 0.0, "drift": 0.0, "warmup_steps": 0, "checkpoint_every": 0}
    )
    topo = Topology(hosts=1, ranks_per_host=4)
    clean = list(TimingModel(topo, noise=noise).windows(3))
    dropped = list(TimingModel(topo, noise=noise, faults=[parse_fault("mfu:at=2,mag=0.05")]).windows(3))
    before = sum(clean[2].step_time_s)
    after = sum(dropped[2].step_time_s)
    assert before / after == pytest.approx(0.95, rel=1e-9)  # MFU (tokens per second) falls by 5%
    grew = dropped[2].ranks[0].comm_exposed_s - clean[2].ranks[0].comm_exposed_s
    assert grew == pytest.approx(after / 16 - before / 16, rel=1e-9)
    assert sum(dropped[1].step_time_s) == pytest.approx(sum(clean[1].step_time_s))


def test_hang_stops_every_rank_and_silent_stops_one() -> None:
    topo = Topology(hosts=1, ranks_per_host=4)
    hung = TimingModel(topo, faults=[parse_fault("hang:rank=1,at=3")])
    assert hung.hang_at == 3 and len(list(hung.windows(10))) == 3
    silent = list(TimingModel(topo, faults=[parse_fault("silent:rank=2,at=1")]).windows(3))
    assert [w.silent for w in silent] == [frozenset(), frozenset({2}), frozenset({2})]


def test_tokens_per_step_give_the_requested_mfu() -> None:
    topo = Topology(hosts=2, ranks_per_host=8)
    m = TimingModel(topo, step_time_s=2.0, mfu=0.4)
    mfu = m.tokens_per_step / 2.0 * m.flops_per_token / (topo.world * m.peak_flops)
    assert mfu == pytest.approx(0.4, rel=1e-3)
    assert m.convention["peak_flops"] == m.peak_flops and m.convention["formula"] == "explicit"
