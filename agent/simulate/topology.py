"""A simulated job's shape: hosts, ranks per host, and the data/tensor/pipeline layout.

Ranks are laid out as the agent reads them from a real launcher (:mod:`stepwatch._env`,
Megatron-LM's order: tensor-parallel fastest, pipeline stage slowest), so every simulated
rank reports exactly the identity a real one would. A communicator group of type X holds
the ranks that agree on every coordinate but X.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from .._env import Layout, RankInfo, coords_for

GROUP_TYPES: tuple[str, ...] = ("dp", "tp", "cp", "pp")


@dataclass(frozen=True)
class Topology:
    """``hosts`` x ``ranks_per_host`` ranks split into ``tp`` x ``pp`` x ``cp`` x data parallel."""

    hosts: int = 4
    ranks_per_host: int = 8
    tp: int = 1
    pp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        if self.hosts < 1 or self.ranks_per_host < 1:
            raise ValueError("need at least one host and one rank per host")
        if min(self.tp, self.pp, self.cp) < 1 or self.world % (self.tp * self.pp * self.cp):
            raise ValueError(f"world size {self.world} is not divisible by tp*pp*cp")

    @property
    def world(self) -> int:
        return self.hosts * self.ranks_per_host

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def layout(self) -> Layout:
        return Layout(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp)

    @property
    def model_parallel(self) -> bool:
        return self.tp * self.pp * self.cp > 1

    def host(self, rank: int) -> str:
        return f"sim-n{rank // self.ranks_per_host:04d}"

    def host_index(self, rank: int) -> int:
        return rank // self.ranks_per_host

    @cached_property
    def coords(self) -> list[dict[str, int]]:
        lay = self.layout
        return [coords_for(r, lay) for r in range(self.world)]

    def rank_info(self, rank: int) -> dict[str, Any]:
        """The ``rank`` section of a payload, as the agent would send it."""
        return RankInfo(
            rank=rank,
            local_rank=rank % self.ranks_per_host,
            world_size=self.world,
            host=self.host(rank),
            layout=self.layout,
            coords=self.coords[rank],
        ).to_dict()

    def group_id(self, rank: int, gtype: str) -> str:
        c = self.coords[rank]
        return f"{gtype}:" + ":".join(f"{d}{c.get(d, 0)}" for d in GROUP_TYPES if d != gtype)

    @cached_property
    def group_types(self) -> tuple[str, ...]:
        """Communicator types with more than one member (none in pure data parallel)."""
        if not self.model_parallel:
            return ()
        sizes = {"dp": self.dp, "tp": self.tp, "cp": self.cp, "pp": self.pp}
        return tuple(t for t in GROUP_TYPES if sizes[t] > 1)

    @cached_property
    def groups(self) -> dict[tuple[str, str], list[int]]:
        """Members of every communicator group, keyed by (type, id)."""
        out: dict[tuple[str, str], list[int]] = defaultdict(list)
        for r in range(self.world):
            for t in self.group_types:
                out[(t, self.group_id(r, t))].append(r)
        return dict(out)

    @cached_property
    def dp_groups(self) -> dict[tuple[int, ...], list[int]]:
        """Data-parallel replicas of each (tp, cp, pp) cell: who waits for whom in the gradient all-reduce."""
        out: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for r in range(self.world):
            c = self.coords[r]
            out[(c["tp"], c["cp"], c["pp"])].append(r)
        return dict(out)
