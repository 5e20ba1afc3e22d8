"""numpy arrays as PostgreSQL array parameters in binary form.

Ingest sends each column of a folded group as one array parameter. Formatting floats as
text cost about 0.5 µs each (``repr``), more than everything else in a write; the binary
array format (PostgreSQL's ``array_send``: a header, then length-prefixed big-endian
elements) is built from a numpy array with one vectorised copy. The wrappers are
registered as psycopg dumpers on every new connection (``engine.py``).
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import numpy.typing as npt
from psycopg import pq
from psycopg.adapt import AdaptersMap, Dumper

FLOAT8, INT8, BYTEA = 701, 20, 17
_ARRAY_OID = {FLOAT8: 1022, INT8: 1016, BYTEA: 1001}
_ELEMENT = {FLOAT8: ">f8", INT8: ">i8"}
_NULL, _EIGHT = struct.pack(">i", -1), struct.pack(">i", 8)


class Float8Array(bytes):
    """A float8[] parameter already in binary form."""


class Int8Array(bytes):
    """An int8[] parameter already in binary form."""


class ByteaArray(bytes):
    """A bytea[] parameter already in binary form."""


class _Float8ArrayDumper(Dumper):
    format = pq.Format.BINARY
    oid = _ARRAY_OID[FLOAT8]

    def dump(self, obj: Any) -> bytes:
        return bytes(obj)


class _Int8ArrayDumper(_Float8ArrayDumper):
    oid = _ARRAY_OID[INT8]


class _ByteaArrayDumper(_Float8ArrayDumper):
    oid = _ARRAY_OID[BYTEA]


def register(adapters: AdaptersMap) -> None:
    adapters.register_dumper(Float8Array, _Float8ArrayDumper)
    adapters.register_dumper(Int8Array, _Int8ArrayDumper)
    adapters.register_dumper(ByteaArray, _ByteaArrayDumper)


def encode_bytes(values: list[bytes]) -> ByteaArray:
    """Byte strings (packed steps, ``packed.py``) as a binary bytea[] parameter: each
    length-prefixed, as they are. psycopg's own list adaptation dumped them element by
    element in Python (with the comm section on, a tenth of the collector's time)."""
    header = struct.pack(">iiiii", 1, 0, BYTEA, len(values), 1)
    return ByteaArray(header + b"".join(struct.pack(">i", len(v)) + v for v in values))


def encode(values: npt.ArrayLike) -> Float8Array | Int8Array:
    """One-dimensional numbers (a masked array for NULLs) as a binary array parameter:
    float8[] for floats, int8[] for integers and booleans."""
    if isinstance(values, np.ma.MaskedArray):
        data, nulls = np.ma.getdata(values), np.ma.getmaskarray(values)
    else:
        data, nulls = np.asarray(values), None
    elem = FLOAT8 if data.dtype.kind == "f" else INT8
    n = len(data)
    has_null = nulls is not None and bool(nulls.any())
    header = struct.pack(">iiiii", 1, int(has_null), elem, n, 1)
    if nulls is None or not has_null:
        rec = np.empty(n, dtype=[("len", ">i4"), ("val", _ELEMENT[elem])])
        rec["len"] = 8
        rec["val"] = data
        body = rec.tobytes()
    elif nulls.all():
        body = _NULL * n
    else:
        # Slices of the big-endian buffer: a numpy scalar's own bytes would be native-endian.
        raw = data.astype(_ELEMENT[elem]).tobytes()
        body = b"".join(
            _NULL if miss else _EIGHT + raw[8 * i : 8 * i + 8] for i, miss in enumerate(nulls.tolist())
        )
    wrap = Float8Array if elem == FLOAT8 else Int8Array
    return wrap(header + body)
