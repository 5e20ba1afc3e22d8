"""FLOPs and MFU: what the utilisation of a run is measured against, fixed once at init.

- :mod:`.convention`: :class:`Convention` (the choices behind an MFU number, stored with
  the run) and :func:`per_token_rate`, the one MFU formula the agent and the collector use.
- :mod:`.formulas`: FLOPs per token by named formula (``6N``, ``6N+12LHQT``), N, HFU.
- :mod:`.peaks`: dense peak FLOP/s per device and dtype, each row with its source.
- :mod:`.measure`: the ``measured`` convention (``torch.utils.flop_counter``).
- :mod:`.resolve`: :func:`resolve_convention`, from ``init``'s arguments and the model.

Importing this package does not import torch (only measuring and counting do).
"""

from __future__ import annotations

from .convention import ATTENTIONS, FORMULAS, RECOMPUTES, Convention, per_token_rate
from .formulas import count_params, flops_per_token
from .measure import FlopsUnavailableError, measure_flops_per_token
from .peaks import UnknownPeakWarning, lookup_peak
from .resolve import resolve_convention

__all__ = [
    "ATTENTIONS",
    "FORMULAS",
    "RECOMPUTES",
    "Convention",
    "FlopsUnavailableError",
    "UnknownPeakWarning",
    "count_params",
    "flops_per_token",
    "lookup_peak",
    "measure_flops_per_token",
    "per_token_rate",
    "resolve_convention",
]
