"""What a rank forked by ``launch.forked`` sees, written as one JSON line to its output;
it then does what its first argument says: exit with that code, ``sleep`` (until
killed), ``interrupt`` (an uncaught KeyboardInterrupt) or ``raise`` (an uncaught error).
Its last line is written without a flush: the interpreter's exit flushes it."""

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
    little where it was mapped apart (above the mmap threshold: glibc's default one moves
    up to 32 MiB) or trimmed."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallinfo2.restype = _Mallinfo2
    block = libc.malloc(size)
    libc.free(block)
    return int(libc.mallinfo2().keepcost)


BLOCK = 31 << 20
KEPT = _kept_after_free(BLOCK)

print(
    json.dumps(
        {
            "pid": os.getpid(),
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
what = sys.argv[1]
if what == "sleep":
    time.sleep(120)
print("last line, not flushed")
if what == "interrupt":
    raise KeyboardInterrupt
if what == "raise":
    raise ValueError("the rank failed")
raise SystemExit(int(what))
