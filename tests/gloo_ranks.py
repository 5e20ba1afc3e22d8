"""Real gloo ranks for the tests, forked from one server process that imported torch once.

``torch.multiprocessing.spawn`` starts each rank as a fresh interpreter, which imports
torch (about 1.4 CPU-seconds here) and, in ``DistributedDataParallel``'s constructor,
``torch._dynamo`` (about 1 CPU-second more, quiet; 2.4-3.4 s of wall time when four ranks
start at once on 2 cores: DDP asks it for its optimizer mode). The two DDP files' 18 ranks
took 67 CPU-seconds in all, 11 forked from the server (busy time of the whole machine,
``/proc/stat``, the files alone). With the ``forkserver`` method the ranks are forked from
a process that imported those modules once (per pytest worker): still separate processes
with their own gloo group, started as torch's launcher allows. The forkserver is
single-threaded, so forking it is safe where forking a pytest worker (threads of its own)
is not.

A forkserver passes its children the environment it started with, not the caller's
current one: ranks get what they need as arguments (and ``OMP_NUM_THREADS=1``, set here
before the server starts). A preloaded module that fails to import is skipped without a
word (Python's forkserver): the ranks then import it themselves, slower but the same.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from stepwatch.demo import launch

#: Imported once by the forkserver (``torch._dynamo``: see the module docstring): the
#: launcher's list (``launch.forked``), written once.
PRELOAD = list(launch.PRELOAD)


def spawn(fn: Callable[..., Any], args: tuple[Any, ...], nprocs: int) -> None:
    """``fn(rank, *args)`` in ``nprocs`` processes; returns once all exited, raises if one failed."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server first starts
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")
