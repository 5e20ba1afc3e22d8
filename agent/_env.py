"""Where this process sits in the job: rank, host and parallel layout.

Read once at ``init`` from the launcher's environment (torchrun sets ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``; Slurm sets ``SLURM_PROCID``, ``SLURM_LOCALID``,
``SLURM_NTASKS``), so that the agent never needs ``torch.distributed`` to be
initialised, and never issues a collective of its own. Likewise the number of the job's
ranks on this host (:func:`local_world_size`) and the job's identity on it
(:func:`job_identity`), which per-host batching needs (``_relay``).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

#: Parallel dimensions, fastest-varying first. This is Megatron-LM's default rank
#: order (tp-cp-ep-dp-pp without ep, which shares ranks with dp): consecutive ranks
#: form a tensor-parallel group, and pipeline stages are the outermost blocks.
LAYOUT_ORDER: tuple[str, ...] = ("tp", "cp", "dp", "pp")


@dataclass(frozen=True)
class Layout:
    """Sizes of the parallel dimensions. The default is pure data parallelism."""

    dp: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    def to_dict(self) -> dict[str, int]:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep}


@dataclass(frozen=True)
class RankInfo:
    """Identity of one training process, shipped with every payload."""

    rank: int
    local_rank: int
    world_size: int
    host: str
    layout: Layout
    coords: Mapping[str, int] = field(default_factory=dict)

    @property
    def counts_tokens(self) -> bool:
        """True for one rank per data-parallel replica.

        Job throughput sums tokens over replicas, once per replica: ranks that share a
        replica (tensor, context or pipeline peers) see the same tokens.
        """
        return all(self.coords.get(dim, 0) == 0 for dim in ("tp", "cp", "pp"))

    def to_dict(self) -> dict[str, object]:
        return {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "world_size": self.world_size,
            "host": self.host,
            "layout": self.layout.to_dict(),
            "coords": dict(self.coords),
            "counts_tokens": self.counts_tokens,
        }


def _int_env(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                continue
    return None


def local_world_size(env: Mapping[str, str] | None = None) -> int:
    """How many of the job's ranks run on this host, as the launcher says; 0 where it does
    not say (a lone process, or a launcher that sets none of these).

    The innermost launcher first, as for the rank (:func:`detect`): a launcher started by
    another sees its parent's variables too. torchrun's ``LOCAL_WORLD_SIZE`` (torchrun
    started by ``srun``, one task a node, runs several ranks in that task), then Open
    MPI's ``OMPI_COMM_WORLD_LOCAL_SIZE`` (``mpirun`` in a Slurm allocation starts its
    daemons with ``srun``, one task a node, and its ranks inherit that step's variables),
    then Slurm's ``SLURM_STEP_TASKS_PER_NODE``, the tasks ``srun`` started on each node of
    the step (``srun`` sets no ``LOCAL_WORLD_SIZE``; scripts that export ``RANK``,
    ``LOCAL_RANK`` and ``WORLD_SIZE`` from Slurm's variables for ``torch.distributed``
    seldom export it either), this node's entry by its index: ``SLURM_STEP_NODEID``, the
    node's index in the step, where set (Slurm's source names it; ``srun`` 22.05 does not
    set it in a task's environment), else ``SLURM_NODEID``, its index in the job's nodes
    (the same for a step over all of them)."""
    env = os.environ if env is None else env
    for name in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_STEP_TASKS_PER_NODE"):
        value = env.get(name)
        if value in (None, ""):
            continue
        if name == "SLURM_STEP_TASKS_PER_NODE":
            return slurm_tasks_on_node(value, _int_env(env, "SLURM_STEP_NODEID", "SLURM_NODEID"))
        try:
            return max(0, int(value))
        except ValueError:
            return 0
    return 0


def slurm_tasks_on_node(text: str, node_id: int | None) -> int:
    """This node's count in Slurm's compressed tasks-per-node list (``8``, ``8(x4)``,
    ``5,4(x3)``: a count per node of the step, in node order, ``(xN)`` repeating it);
    0 where it cannot be read, or the nodes differ and ``node_id`` (this node's index in
    the step) does not pick one."""
    runs: list[tuple[int, int]] = []  # (count, nodes)
    for part in text.split(","):
        count, _, repeat = part.strip().partition("(x")
        if repeat and not repeat.endswith(")"):
            return 0
        try:
            n = int(count)
            nodes = int(repeat.removesuffix(")")) if repeat else 1
        except ValueError:
            return 0
        if n < 0 or nodes < 1:
            return 0
        runs.append((n, nodes))
    if len({n for n, _ in runs}) == 1:
        return runs[0][0]
    if node_id is not None and node_id >= 0:
        for n, nodes in runs:
            if node_id < nodes:
                return n
            node_id -= nodes
    return 0


def job_identity(env: Mapping[str, str] | None = None) -> str:
    """What the ranks of one job on a host share and two jobs on it do not: torchrun's
    rendezvous (``MASTER_ADDR:MASTER_PORT``), Slurm's job and step, and the PMIx
    namespace (Open MPI's ``mpirun``, ``srun --mpi=pmix``: one per job). Empty parts
    where a launcher sets none of them."""
    env = os.environ if env is None else env
    return "|".join(
        env.get(k, "")
        for k in ("MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID", "SLURM_STEP_ID", "PMIX_NAMESPACE")
    )


def coords_for(rank: int, layout: Layout) -> dict[str, int]:
    """Coordinates of ``rank`` in the layout, tensor-parallel fastest (see LAYOUT_ORDER)."""
    coords: dict[str, int] = {}
    rest = rank
    for dim in LAYOUT_ORDER:
        size = getattr(layout, dim)
        coords[dim] = rest % size
        rest //= size
    return coords


def detect(
    env: Mapping[str, str] | None = None,
    *,
    rank: int | None = None,
    local_rank: int | None = None,
    world_size: int | None = None,
    host: str | None = None,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
) -> RankInfo:
    """Build the RankInfo from explicit arguments, then torchrun, then Slurm variables.

    Raises ValueError when the layout does not divide the world size: that is a
    configuration mistake the user must hear about at init, not silently absorb.
    """
    env = os.environ if env is None else env
    # The innermost launcher first: ``mpirun`` in a Slurm allocation starts its daemons
    # with ``srun`` (one task a node), and its ranks inherit that step's ``SLURM_PROCID``,
    # the same on every rank of a node.
    r = rank if rank is not None else _int_env(env, "RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")
    lr = (
        local_rank
        if local_rank is not None
        else _int_env(env, "LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")
    )
    ws = (
        world_size
        if world_size is not None
        else _int_env(env, "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS")
    )
    r = 0 if r is None else r
    ws = 1 if ws is None else ws
    lr = r if lr is None else lr
    if ws < 1 or not 0 <= r < ws:
        raise ValueError(f"rank {r} is outside world size {ws}")
    for name, size in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)):
        if size < 1:
            raise ValueError(f"{name} must be >= 1, got {size}")
    model_parallel = tp * pp * cp
    if ws % model_parallel:
        raise ValueError(f"world size {ws} is not divisible by tp*pp*cp = {model_parallel}")
    layout = Layout(dp=ws // model_parallel, tp=tp, pp=pp, cp=cp, ep=ep)
    hostname = host or env.get("STEPWATCH_HOST") or env.get("SLURMD_NODENAME") or socket.gethostname()
    return RankInfo(
        rank=r,
        local_rank=lr,
        world_size=ws,
        host=hostname,
        layout=layout,
        coords=coords_for(r, layout),
    )
