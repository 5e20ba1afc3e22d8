from __future__ import annotations

import pytest

from stepwatch._env import Layout, coords_for, detect


def test_torchrun_environment() -> None:
    info = detect({"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8"}, host="n2")
    assert (info.rank, info.local_rank, info.world_size, info.host) == (5, 1, 8, "n2")
    assert info.layout == Layout(dp=8)
    assert info.counts_tokens


def test_slurm_environment_and_hostname() -> None:
    info = detect(
        {"SLURM_PROCID": "3", "SLURM_LOCALID": "3", "SLURM_NTASKS": "16", "SLURMD_NODENAME": "gpu-17"}
    )
    assert (info.rank, info.local_rank, info.world_size, info.host) == (3, 3, 16, "gpu-17")


def test_defaults_to_a_single_process() -> None:
    info = detect({}, host="h")
    assert (info.rank, info.local_rank, info.world_size) == (0, 0, 1)


def test_layout_coordinates_tensor_parallel_fastest() -> None:
    layout = Layout(dp=2, tp=2, pp=2)
    assert coords_for(0, layout) == {"tp": 0, "cp": 0, "dp": 0, "pp": 0}
    assert coords_for(1, layout) == {"tp": 1, "cp": 0, "dp": 0, "pp": 0}
    assert coords_for(2, layout) == {"tp": 0, "cp": 0, "dp": 1, "pp": 0}
    assert coords_for(7, layout) == {"tp": 1, "cp": 0, "dp": 1, "pp": 1}
    # One rank per data-parallel replica counts tokens: tp=0, pp=0.
    counting = [
        r for r in range(8) if detect({"RANK": str(r), "WORLD_SIZE": "8"}, tp=2, pp=2, host="h").counts_tokens
    ]
    assert counting == [0, 2]


@pytest.mark.parametrize(
    ("env", "kwargs", "message"),
    [
        ({"RANK": "4", "WORLD_SIZE": "4"}, {}, "outside world size"),
        ({"WORLD_SIZE": "6"}, {"tp": 4}, "not divisible"),
        ({}, {"pp": 0}, "pp must be >= 1"),
    ],
)
def test_bad_layout_raises_at_init(env: dict[str, str], kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        detect(env, host="h", **kwargs)
