"""Per-step values packed into one binary column: one value per step, as little-endian
float64, NaN where the value is unknown (a NULL in a row per step).

The staged collective timing (``step_timings``) is written by every DDP rank for every
step and read once, by the analysis of the step's window. Staged as a row per rank and
step, it was most of ingest's rows: with the comm section on (the default with a DDP
model) the collector's PostgreSQL spent 438 µs per 64-step rank-window against 35 µs
without it, inserting, indexing and then deleting 64 rows. Packed, a batch's steps are one
row per rank, and a value read back is the float written, bit for bit, so the analysis
sees what it saw with a row per step.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

#: The packed element: float64, little-endian whatever the host's byte order.
DTYPE = np.dtype("<f8")


def pack(values: npt.NDArray[np.float64]) -> bytes:
    """``values`` (NaN: unknown) as stored."""
    return np.ascontiguousarray(values, dtype=DTYPE).tobytes()


def unpack(blob: bytes) -> npt.NDArray[np.float64]:
    """A packed column back as float64 (read-only: a view of ``blob``)."""
    return np.frombuffer(blob, dtype=DTYPE)
