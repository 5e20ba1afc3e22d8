from __future__ import annotations

import pytest

from stepwatch._env import Layout, coords_for, detect, local_world_size, slurm_tasks_on_node


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


def test_mpirun_inside_a_slurm_allocation_is_read_as_mpirun() -> None:
    """``mpirun`` in an sbatch allocation starts its daemons with ``srun``, one task a
    node: its ranks inherit that step's Slurm variables (the same on every rank of the
    node), beside their own Open MPI ones, which are the job's."""
    env = {
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS": "4",
        "SLURM_STEP_TASKS_PER_NODE": "1(x4)",
        "OMPI_COMM_WORLD_RANK": "13",
        "OMPI_COMM_WORLD_LOCAL_RANK": "5",
        "OMPI_COMM_WORLD_SIZE": "32",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "8",
    }
    info = detect(env, host="h")
    assert (info.rank, info.local_rank, info.world_size) == (13, 5, 32)
    assert local_world_size(env) == 8


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


@pytest.mark.parametrize(
    ("text", "node_id", "expected"),
    [
        ("8", None, 8),
        ("8(x4)", None, 8),  # every node the same: no node id needed
        ("8(x2),8", 2, 8),
        ("5,4(x3)", 0, 5),  # heterogeneous: this node's own count
        ("5,4(x3)", 1, 4),
        ("5,4(x3)", 3, 4),
        ("2(x2),1", 2, 1),
        ("5,4(x3)", 4, 0),  # past the step's nodes
        ("5,4(x3)", None, 0),  # which node is unknown
        ("5,4(x3", 0, 0),  # not Slurm's format: unknown, never a guess
        ("many", None, 0),
        ("8(x0)", None, 0),
    ],
)
def test_slurm_tasks_per_node_is_read_for_this_node(text: str, node_id: int | None, expected: int) -> None:
    assert slurm_tasks_on_node(text, node_id) == expected


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, 0),
        ({"LOCAL_WORLD_SIZE": "8"}, 8),
        ({"LOCAL_WORLD_SIZE": "-1"}, 0),
        ({"SLURM_STEP_TASKS_PER_NODE": "5,4(x3)", "SLURM_NODEID": "2"}, 4),
        # The node's index in the step, where set, before its index in the job's nodes.
        ({"SLURM_STEP_TASKS_PER_NODE": "5,4(x3)", "SLURM_STEP_NODEID": "0", "SLURM_NODEID": "2"}, 5),
        # torchrun under srun (one task a node runs torchrun): torchrun's count.
        ({"SLURM_STEP_TASKS_PER_NODE": "1(x4)", "LOCAL_WORLD_SIZE": "8"}, 8),
        # An allocation's tasks per node (sbatch, salloc) is not the step's: not read.
        ({"SLURM_TASKS_PER_NODE": "8(x4)"}, 0),
        ({"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, 4),
    ],
)
def test_the_hosts_ranks_come_from_the_launcher(env: dict[str, str], expected: int) -> None:
    assert local_world_size(env) == expected
