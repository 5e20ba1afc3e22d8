"""What counts as communication in a trace, and what each collective is called (pure).

One table for the whole parser, so that a launcher or kernel family is added in one
place and its test sits beside the others (``tests/unit/test_collectives.py``).

Device work is communication when the host op that launched it says so, else when its
kernel's name does:

1. **Launching host op.** A kernel (or copy) whose launch (``cuda_runtime`` /
   ``cuda_driver`` event of the same ``correlation``) lies inside one of the
   :data:`LAUNCHER_PREFIXES` host spans on the launching thread: ``c10d::*``,
   ``_c10d_functional::*``, ``nccl:*`` (torch's NCCL annotations), ``record_param_comms``,
   ``symm_mem::*`` (symmetric-memory collectives: ``multimem_all_reduce_kernel`` and
   friends, which carry no "nccl" in their names), ``gloo:*``/``mpi:*``/``ucc:*``.
   Whatever the op launches is the collective's cost, copies included.
2. **Kernel name**, for work with no launch in the trace or launched outside such an op
   (custom extensions launch from C++ without a torch op): the case-insensitive
   substrings of :data:`KERNEL_MARKERS`: NCCL and RCCL, NVSHMEM, DeepEP (MoE
   dispatch/combine), pplx-kernels, MSCCL++, torch symmetric memory, and the custom
   all-reduce kernels of vLLM / SGLang (``cross_device_reduce``) and TensorRT-LLM
   (``allreduce`` kernels).

The op name comes from the most specific source that names one (:func:`normalize_op`
maps each to a closed set): the kernel's ``Collective name`` (Kineto copies
``record_param_comms`` metadata onto NCCL kernels since torch 2.1), the
``record_param_comms`` op of its ``External id``, the launching host ops innermost
first (older PyTorch: ``nccl:all_to_all`` inside ``c10d::alltoall_base_``, whose kernel
is a bare ``SendRecv``), then the kernel's own name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

__all__ = [
    "KERNEL_MARKERS",
    "LAUNCHER_PREFIXES",
    "OPS",
    "dtype_bytes",
    "host_op_bytes",
    "is_comm_kernel_name",
    "is_launcher",
    "normalize_op",
    "tensor_bytes",
]

LAUNCHER_PREFIXES: tuple[str, ...] = (
    "c10d::",
    "_c10d_functional::",
    "c10d_functional::",
    "record_param_comms",
    "nccl:",
    "symm_mem::",
    "gloo:",
    "mpi:",
    "ucc:",
)
"""Host ops (``cpu_op`` or ``user_annotation``) whose launches are communication."""

KERNEL_MARKERS: tuple[str, ...] = (
    "nccl",  # ncclDevKernel_*, ncclKernel_* (NCCL and RCCL)
    "rccl",
    "nvshmem",  # nvshmemi_* transfer and barrier kernels
    "deep_ep",  # deep_ep::intranode::dispatch / combine, internode, internode_ll
    "pplx",  # pplx-kernels all-to-all dispatch / combine
    "mscclpp",
    "multimem_all_",  # torch symm_mem multimem_all_reduce_kernel / multimem_all_gather_kernel
    "one_shot_all_reduce",  # torch symm_mem
    "two_shot_all_reduce",
    "cross_device_reduce",  # vLLM / SGLang custom all-reduce
    "allreducekernel",  # TensorRT-LLM oneShotAllReduceKernel / twoShotAllReduceKernel
    "lamport",  # TensorRT-LLM Lamport all-reduce
)
"""Case-insensitive substrings of kernel names that are communication."""

OPS: tuple[str, ...] = (
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "all_to_all",
    "broadcast",
    "send_recv",
    "send",
    "recv",
    "barrier",
    "reduce",
    "gather",
    "scatter",
    "other",
)
"""The closed set of op names (bounded label cardinality)."""

# Canonical op names, matched in this order against the name with "_" removed.
_OP_TABLE: tuple[tuple[str, str], ...] = (
    ("allreduce", "all_reduce"),
    ("crossdevicereduce", "all_reduce"),  # vLLM / SGLang custom all-reduce
    ("reducescatter", "reduce_scatter"),
    ("allgather", "all_gather"),
    ("alltoall", "all_to_all"),
    ("dispatch", "all_to_all"),  # MoE expert-parallel dispatch (DeepEP, pplx)
    ("combine", "all_to_all"),  # MoE expert-parallel combine
    ("broadcast", "broadcast"),
    ("sendrecv", "send_recv"),
    ("send", "send"),
    ("recv", "recv"),
    ("monitoredbarrier", "barrier"),
    ("barrier", "barrier"),
    ("reduce", "reduce"),
    ("gather", "gather"),
    ("scatter", "scatter"),
)
# Name families matched as prefixes (the exact op follows the prefix); the others are
# searched anywhere in the name, since their op sits inside it.
_PREFIX_ONLY = frozenset({"send", "recv", "reduce", "gather", "scatter", "barrier", "monitoredbarrier"})
_KERNEL_PREFIXES = ("nccldevkernel_", "ncclkernel_")
_NAMESPACE = re.compile(r"^[a-z0-9_]+::(?:[a-z0-9_]+::)*")
_NAME_PREFIXES = ("gloo:", "nccl:", "mpi:", "ucc:")

# Bytes per element, keyed by lower-cased dtype names as they appear in traces:
# c10 ScalarType names in record_param_comms ("Float", "BFloat16") and C++ type
# names in "Input type" ("float", "c10::BFloat16", "long int").
_DTYPE_BYTES: dict[str, int] = {
    "float": 4,
    "float32": 4,
    "double": 8,
    "float64": 8,
    "half": 2,
    "float16": 2,
    "c10::half": 2,
    "bfloat16": 2,
    "c10::bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "c10::float8_e4m3fn": 1,
    "c10::float8_e5m2": 1,
    "long": 8,
    "long int": 8,
    "int64": 8,
    "int64_t": 8,
    "int": 4,
    "int32": 4,
    "short": 2,
    "short int": 2,
    "int16": 2,
    "byte": 1,
    "uint8": 1,
    "unsigned char": 1,
    "char": 1,
    "int8": 1,
    "signed char": 1,
    "bool": 1,
    "complexfloat": 8,
    "c10::complex<float>": 8,
    "complexdouble": 16,
    "c10::complex<double>": 16,
}


def is_launcher(name: str) -> bool:
    """A host op whose launches are communication (:data:`LAUNCHER_PREFIXES`)."""
    return name.startswith(LAUNCHER_PREFIXES)


def is_comm_kernel_name(name: str) -> bool:
    """A kernel name that belongs to a communication library (:data:`KERNEL_MARKERS`)."""
    low = name.lower()
    return any(m in low for m in KERNEL_MARKERS)


def normalize_op(name: str) -> str:
    """Canonical collective name from a host op, a kernel or a ``Collective name`` value.

    Returns one of :data:`OPS`. NCCL runs all_to_all as grouped send/recv, so a bare
    ``SendRecv`` kernel is ``send_recv`` unless a better source names the op.
    """
    low = name.split("(", 1)[0].split("<", 1)[0].strip().lower().removeprefix("void ")
    for prefix in _KERNEL_PREFIXES:
        if low.startswith(prefix):
            low = low[len(prefix) :].split("_", 1)[0]
            break
    else:
        for prefix in _NAME_PREFIXES:
            if low.startswith(prefix):
                low = low[len(prefix) :]
                break
        else:
            low = _NAMESPACE.sub("", low)
    compact = low.replace("_", "")
    for key, op in _OP_TABLE:
        if compact.startswith(key) or (key not in _PREFIX_ONLY and key in compact):
            return op
    return "other"


def dtype_bytes(v: object) -> int | None:
    """Bytes per element of a dtype name as traces write it, ``None`` if unknown."""
    if not isinstance(v, str):
        return None
    return _DTYPE_BYTES.get(v.strip().lower())


def _elements(dims: object) -> int | None:
    if not isinstance(dims, list) or not dims:
        return None
    n = 1
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            return None
        n *= d
    return n


def tensor_bytes(args: Mapping[str, object]) -> list[int] | None:
    """Bytes of each tensor argument of a host op (``Input Dims`` x ``Input type``,
    written with ``record_shapes``); ``None`` when no argument is a sized tensor."""
    types = args.get("Input type")
    dims = args.get("Input Dims")
    if not isinstance(types, list) or not isinstance(dims, list) or len(types) != len(dims):
        return None
    out = []
    for t, d in zip(types, dims, strict=True):
        size = dtype_bytes(t)
        n = _elements(d)
        if size is not None and n is not None:
            out.append(size * n)
    return out or None


def host_op_bytes(
    chain: Sequence[tuple[str, Mapping[str, object]]], op: str, group_size: int | None
) -> int | None:
    """Bytes of a collective from its launching host ops (outermost first), nccl-tests
    convention: the larger of input and output.

    A ``c10d::*`` op lists output and input tensors (``_allgather_base_(out, in)``,
    ``alltoall_base_(out, in, ...)``), so the largest of its tensors is the answer; an
    ``nccl:*`` annotation lists the input only, which for all_gather is scaled by the
    group size. ``None`` when neither says.
    """
    for name, args in chain:
        if name.startswith(("c10d::", "_c10d_functional::", "c10d_functional::", "symm_mem::")):
            sizes = tensor_bytes(args)
            if sizes:
                return max(sizes)
    for name, args in reversed(chain):
        if name.startswith("nccl:"):
            sizes = tensor_bytes(args)
            if sizes:
                total = sum(sizes)
                if op == "all_gather":
                    return None if group_size is None else total * group_size
                return total
    return None
