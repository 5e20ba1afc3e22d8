"""stepwatch: live training-efficiency monitoring with one line per step.

    import stepwatch
    sw = stepwatch.init(run="llama-8b-pretrain", model=model, seq_len=4096)
    for batch in sw.loader(train_loader):
        loss = train_step(batch)
        sw.step(tokens=n_nonpad_tokens)

``init`` reads rank and host from the torchrun / Slurm environment and the collector
URL, token and run name from arguments or ``STEPWATCH_*`` variables. It never touches
the network on the calling thread; a background thread ships compact batches.
"""

from __future__ import annotations

__version__ = "0.1.0"

from ._agent import Stepwatch
from ._api import current, init
from ._comm_timing import comm_hook

__all__ = ["Stepwatch", "__version__", "comm_hook", "current", "init"]
