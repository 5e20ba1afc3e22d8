"""Real gloo ranks for the tests, forked from one server process that imported torch once.

``torch.multiprocessing.spawn`` starts each rank as a fresh interpreter, which imports
torch (1.3 CPU-seconds here) and, in ``DistributedDataParallel``'s constructor,
``torch._dynamo`` (2.4 CPU-seconds more: DDP asks it for its optimizer mode). Four ranks
of a DDP test paid 14 CPU-seconds for that, more than their training. Started with the
``forkserver`` method, the ranks are forked from a process that imported those modules
once (per pytest worker): still separate processes with their own gloo group, started as
torch's launcher allows. The forkserver is single-threaded, so forking it is safe where
forking a pytest worker (threads of its own) is not.

A forkserver passes its children the environment it started with, not the caller's
current one: ranks get what they need as arguments (and ``OMP_NUM_THREADS=1``, set here
before the server starts).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

#: Imported once by the forkserver (``torch._dynamo``: see the module docstring).
PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "stepwatch"]


def spawn(fn: Callable[..., Any], args: tuple[Any, ...], nprocs: int) -> None:
    """``fn(rank, *args)`` in ``nprocs`` processes; returns once all exited, raises if one failed."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server first starts
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")
