"""What a rank forked by ``launch.forked`` sees, written as one JSON line to its output;
it then exits with the code its first argument names (``sleep``: waits to be killed)."""

from __future__ import annotations

import ctypes
import json
import os
import socket
import sys
import time

# Whether torch was imported before this module ran: by the forkserver (a forked rank) or
# not at all (a fresh interpreter, which this module never makes import it).
PRELOADED = "torch" in sys.modules


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
        )
    ] + [("keepcost", ctypes.c_size_t)]


def _kept_after_free(size: int) -> int:
    """The top of the heap the allocator keeps after ``size`` bytes are freed: the block
    itself where it came from the heap and is not given back (a trim threshold above it),
    little where it was mapped apart (above the mmap threshold, 32 MiB at most by default
    glibc's dynamic one) or trimmed."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallinfo2.restype = _Mallinfo2
    block = libc.malloc(size)
    libc.free(block)
    return int(libc.mallinfo2().keepcost)


KEPT = _kept_after_free(24 << 20)

print(
    json.dumps(
        {
            "argv": sys.argv[1:],
            "env": dict(os.environ),
            "nice": os.nice(0),
            "preloaded": PRELOADED,
            "interfaces": sorted(name for _, name in socket.if_nameindex()),
            "main": __name__,
            "kept": KEPT,
        }
    ),
    flush=True,
)
if sys.argv[1] == "sleep":
    time.sleep(120)
raise SystemExit(int(sys.argv[1]))
