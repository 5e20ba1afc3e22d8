"""The counting wrappers on a real one-rank gloo group, in this process: a call that
raises raises the same and is not left looking in flight, a failing counter never
reaches the caller, install / release / uninstall do what they say."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from stepwatch import _collectives
from stepwatch._comm_timing import CommTiming


@pytest.fixture
def world(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        _collectives.uninstall()
        dist.destroy_process_group()


def _timing() -> CommTiming:
    return CommTiming(4, lambda: (1, 0))


def _world(t: CommTiming) -> tuple[int, int]:
    g = t.seq["world"]
    return g.entered, g.completed


def test_a_call_that_raises_raises_the_same_and_is_not_left_in_flight(world: None) -> None:
    orig = dist.all_gather_single
    with pytest.raises(RuntimeError, match="invalid tensor size") as plain:
        orig(torch.empty(3), torch.ones(2))  # the wrong output size
    t = _timing()
    assert _collectives.install(t)
    with pytest.raises(type(plain.value)) as counted:
        dist.all_gather_single(torch.empty(3), torch.ones(2))
    assert str(counted.value) == str(plain.value)
    assert _world(t) == (1, 1), "a failed call must not look like the collective a rank is stuck in"


def test_a_failing_counter_never_reaches_training(world: None) -> None:
    class Broken(CommTiming):
        def enter(self, group: str, op: int) -> tuple[int, int] | None:
            raise RuntimeError("counter broken")

    assert _collectives.install(Broken(4, lambda: (1, 0)))
    x = torch.arange(4.0)
    dist.all_reduce(x)
    dist.all_reduce(x, async_op=True).wait()
    assert torch.equal(x, torch.arange(4.0))  # one rank: the sum is the tensor


def test_install_moves_the_counting_release_stops_it_uninstall_restores(world: None) -> None:
    orig = dist.broadcast
    a, b = _timing(), _timing()
    assert _collectives.install(a)
    wrapped = dist.broadcast
    assert wrapped is not orig and wrapped.__wrapped__ is orig  # type: ignore[attr-defined]
    x = torch.ones(2)
    dist.broadcast(x, 0)
    assert _collectives.install(b) and dist.broadcast is wrapped, "installed once"
    dist.broadcast(x, 0, async_op=True).wait()
    dist.barrier()
    assert _world(a) == (1, 1) and _world(b) == (2, 2)
    assert b.groups()[0]["op"] == "barrier"
    _collectives.release(a)  # not the target: nothing changes
    dist.barrier()
    assert _world(b) == (3, 3)
    _collectives.release(b)
    dist.barrier()
    assert _world(b) == (3, 3), "a closed agent's timing still counted"
    _collectives.uninstall()
    assert dist.broadcast is orig


def test_init_with_collectives_counts_into_the_new_agent_and_closing_it_stops(world: None) -> None:
    import stepwatch

    sw = stepwatch.init(
        run="wrap-init",
        url="http://127.0.0.1:9",
        collectives=True,
        rank=0,
        local_rank=0,
        world_size=1,
        profile_every=0,
        flush_timeout_s=0.1,
    )
    try:
        dist.all_reduce(torch.ones(2))
        dist.barrier(async_op=True).wait()
        assert _world(sw.comm_timing) == (2, 2)
        assert sw.comm_timing.groups()[0]["op"] == "barrier"
    finally:
        sw.close(0.1)
    dist.all_reduce(torch.ones(2))
    assert _world(sw.comm_timing) == (2, 2)


def test_a_closed_agent_stops_counting(world: None) -> None:
    import stepwatch
    from stepwatch._env import detect
    from stepwatch.config import AgentConfig

    sw = stepwatch.Stepwatch(
        AgentConfig(run="wrap", url="http://127.0.0.1:9", enabled=True, warmup_steps=0),
        detect({}, rank=0, local_rank=0, world_size=1, host="h"),
        convention=None,
    )
    assert sw.watch_collectives()
    dist.all_reduce(torch.ones(2))
    sw.close(0.1)
    dist.all_reduce(torch.ones(2))
    assert _world(sw.comm_timing) == (1, 1)


def test_a_compiled_region_traces_through_the_wrapper_and_is_not_counted(world: None) -> None:
    t = _timing()
    assert _collectives.install(t)

    def f(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        dist.all_reduce(y)
        return y + 1

    # fullgraph: the wrapper must not break the graph (it calls the original, which
    # dynamo maps to a functional collective), so the call is not counted.
    compiled = torch.compile(f, backend="eager", fullgraph=True)
    assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 3.0))
    assert "world" not in t.seq
    assert torch.equal(f(torch.ones(3)), torch.full((3,), 3.0))
    assert _world(t) == (1, 1)
