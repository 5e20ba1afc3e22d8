"""``stepwatch simulate``: thousands of simulated ranks through the agent's real send path.

- :mod:`.topology`: hosts, ranks per host, data/tensor/pipeline layout, communicator groups.
- :mod:`.faults`: the faults that can be injected and their command-line form.
- :mod:`.model`: seeded step timings with realistic clean noise and the faults.
- :mod:`.entries`: the v2 ``profiles`` entry of each rank, through the agent's entry assembler.
- :mod:`.driver`: windows -> payloads -> :class:`stepwatch._sender.Sender` -> HTTP.
- :mod:`.cli`: the command.
"""

from __future__ import annotations

from .driver import SimResult, Simulation, WindowMismatchError
from .faults import Fault, parse_fault
from .model import Noise, TimingModel, WindowTimings
from .topology import Topology

__all__ = [
    "Fault",
    "Noise",
    "SimResult",
    "Simulation",
    "TimingModel",
    "Topology",
    "WindowMismatchError",
    "WindowTimings",
    "parse_fault",
]
