"""Counting the plain ``torch.distributed`` collectives that DDP's comm hook does not see.

Why: the hang diagnosis (the collector's ``stuck_collectives``) needs, per process group,
how many collectives each rank entered and completed. DDP's gradient buckets reach the
counters through the communication hook (``_comm_timing.comm_hook``); tensor- and
pipeline-parallel code and FSDP2 (``fully_shard``) call ``torch.distributed`` functions
directly. torch 2.13 offers no per-collective Python hook for them: the prototype
``torch.distributed.hooks`` is gone, and the c10d flight recorder
(``TORCH_FR_BUFFER_SIZE``, dumped with the private ``_dump_fr_trace``) records gloo
collectives but leaves every entry ``scheduled`` (no completion) and is read by pickling
its whole ring. So :func:`install` (``sw.watch_collectives()``, or
``stepwatch.init(..., collectives=True)``) replaces the module attributes
``torch.distributed.<op>`` with thin wrappers that count each call in the same
:class:`~stepwatch._comm_timing.GroupSeq` counters as the hook: entered before the call,
completed when a synchronous call returns or, with ``async_op=True``, when the Work's
future completes (a callback on the backend's thread, one store).

What the wrappers see (the README's coverage paragraph says the same):

- ``all_reduce``, ``all_gather``, ``all_gather_single`` / ``all_gather_into_tensor``,
  ``reduce_scatter``, ``reduce_scatter_single`` / ``reduce_scatter_tensor``,
  ``all_to_all``, ``all_to_all_single``, ``broadcast``, ``reduce``, ``gather``,
  ``scatter``, ``barrier``: counted in their group (``group_label``: ``"world"`` for the
  default group), sync and async. FSDP2 calls ``dist.all_gather_single`` and
  ``dist.reduce_scatter_single`` through the module, so its collectives are counted.
- ``send`` / ``recv`` (synchronous): counted in a sequence of their own per pair of
  ranks, ``"<group>:p2p:<lo>-<hi>"`` (global ranks): a pair's sends and receives match in
  order on both ranks, and the group's other members, which take no part, are then not
  named as never having entered them. A ``recv`` from any source is not counted.

What they do not see: ``isend`` / ``irecv`` / ``batch_isend_irecv`` (``P2POp`` checks its
``op`` by identity against torch's own ``isend``/``irecv``, so wrapping them would break
``torch.distributed.pipelining``; and gloo's point-to-point Work has no future to tell
completion), calls through a reference taken before :func:`install`
(``from torch.distributed import all_reduce``) or through
``torch.distributed.distributed_c10d`` directly, functional collectives
(``torch.distributed._functional_collectives``, hence DTensor redistributions and
``parallelize_module`` tensor parallelism) and ``torch.compile``'d graphs (a compiled
region calls the original), and collectives issued from C++ (DDP's reducer: the comm
hook counts those). Calls inside a DDP comm hook are not counted again: the hook counts
the bucket itself.

Every process group this rank is a member of (torch's group registry, read on the
sender thread) is listed at 0 entered until its first collective: a member that hangs
before calling any collective of a group is then named as never having entered the
group's first one, instead of being absent from the group.

Cost: one clock read, a dict look-up and a few stores per call, nothing kept per call
beyond the preallocated ring (``benchmarks/collective_counting.py`` measures it against
the unwrapped call). Nothing here raises into training: a counting failure only loses
the count; the collective's own result and exceptions pass through unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any

from ._comm_timing import MAX_GROUPS, OP_CODES, CommTiming, group_label

#: ``torch.distributed`` function -> the op it is counted as (``wire.COLLECTIVE_OPS``).
COLLECTIVES: dict[str, str] = {
    "all_reduce": "all_reduce",
    "all_gather": "all_gather",
    "all_gather_single": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all": "all_to_all",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "gather": "gather",
    "scatter": "scatter",
    "barrier": "barrier",
}
#: Synchronous point-to-point calls, counted per pair of ranks; the value is the name of
#: the peer's argument (a global rank) and of its group-rank alternative.
P2P: dict[str, tuple[str, str, str]] = {
    "send": ("send", "dst", "group_dst"),
    "recv": ("recv", "src", "group_src"),
}

#: Where the wrappers count: the agent's timing (None: they only call through).
_target: list[CommTiming | None] = [None]
#: The originals of the attributes replaced, to restore them (:func:`uninstall`).
_originals: dict[str, Callable[..., Any]] = {}
#: Process group -> wire label, bounded (a group past the bound is labelled per call).
_labels: dict[Any, str] = {}


class _Quiet(threading.local):
    #: A class default: a thread that never set it reads it without an AttributeError
    #: (``getattr`` with a default on a missing attribute costs a microsecond).
    on = False


#: Per thread: inside a DDP comm hook, whose bucket is counted already.
_quiet = _Quiet()
#: Resolved once at install: ``torch.distributed``, the non-member group sentinel, and
#: ``torch.compiler.is_compiling`` (a compiled region calls the original).
_dist: list[Any] = [None, None, None]


def install(timing: CommTiming) -> bool:
    """Count ``torch.distributed`` collectives into ``timing`` from now on (idempotent: a
    second call only moves the counting to ``timing``). Returns whether the wrappers are
    in place (False where ``torch.distributed`` is unavailable or failed to wrap)."""
    _target[0] = timing
    timing.known_groups = _member_groups
    if _originals:
        return True
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return False
        import torch.compiler
        from torch.distributed.distributed_c10d import GroupMember

        _dist[:] = [dist, GroupMember.NON_GROUP_MEMBER, torch.compiler.is_compiling]
        for name, op in COLLECTIVES.items():
            _wrap(dist, name, _collective_wrapper, op)
        for name, (op, peer, group_peer) in P2P.items():
            _wrap(dist, name, _p2p_wrapper, op, peer, group_peer)
    except Exception:
        uninstall()
        return False
    return True


def release(timing: CommTiming) -> None:
    """Stop counting into ``timing`` (its agent closed); the wrappers then only call
    through until the next :func:`install`."""
    if _target[0] is timing:
        _target[0] = None


def uninstall() -> None:
    """Put back every original still replaced by our wrapper and stop counting."""
    _target[0] = None
    try:
        import torch.distributed as dist
    except Exception:
        return
    for name, orig in list(_originals.items()):
        current = getattr(dist, name, None)
        if getattr(current, "__wrapped__", None) is orig:
            setattr(dist, name, orig)
        del _originals[name]
    _labels.clear()


class Quiet:
    """Calls made inside this context (on this thread) are not counted: a DDP comm hook
    counts its bucket itself and then runs a user's hook that calls ``dist.all_reduce``."""

    __slots__ = ("_prev",)

    def __enter__(self) -> None:
        self._prev = _quiet.on
        _quiet.on = True

    def __exit__(self, *exc: object) -> None:
        _quiet.on = self._prev


def _wrap(dist: Any, name: str, make: Callable[..., Callable[..., Any]], *extra: Any) -> None:
    orig = getattr(dist, name, None)
    if orig is None:
        return
    params = list(inspect.signature(orig).parameters)
    wrapper = make(orig, params, *extra)
    functools.update_wrapper(wrapper, orig)  # name, doc, ``__wrapped__``
    _originals[name] = orig
    setattr(dist, name, wrapper)


def _index(params: list[str], name: str) -> int:
    return params.index(name) if name in params else 1 << 30


def _label(pg: Any) -> str:
    label = _labels.get(pg)
    if label is None:
        label = group_label(pg)
        if len(_labels) < 2 * MAX_GROUPS:
            _labels[pg] = label
    return label


def _member_groups() -> list[str]:
    """The labels of the process groups this rank is a member of (torch keeps only
    those in its registry; sender thread: a copy of the registry's keys)."""
    dist = _dist[0]
    if dist is None:
        return []
    return [_label(pg) for pg in list(dist.distributed_c10d._world.pg_names)]


def _collective_wrapper(orig: Callable[..., Any], params: list[str], op_name: str) -> Callable[..., Any]:
    op = OP_CODES[op_name]
    gi = _index(params, "group")
    ai = _index(params, "async_op")

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _dist[2]():  # first: what dynamo traces of this wrapper is only the original
            return orig(*args, **kwargs)
        t = _target[0]
        if t is None or _quiet.on:
            return orig(*args, **kwargs)
        token = group = None
        async_op = False
        try:
            pg = args[gi] if len(args) > gi else kwargs.get("group")
            async_op = bool(args[ai] if len(args) > ai else kwargs.get("async_op", False))
            # A rank outside ``pg`` calls a collective of it as a no-op: nothing to count.
            if pg != _dist[1]:
                group = _label(pg)
                token = t.enter(group, op)
        except Exception:
            token = None
        return _call(orig, args, kwargs, t, token, group, async_op)

    return wrapper


def _p2p_wrapper(
    orig: Callable[..., Any], params: list[str], op_name: str, peer_arg: str, group_peer_arg: str
) -> Callable[..., Any]:
    op = OP_CODES[op_name]
    gi = _index(params, "group")
    pi = _index(params, peer_arg)
    gpi = _index(params, group_peer_arg)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _dist[2]():  # first: what dynamo traces of this wrapper is only the original
            return orig(*args, **kwargs)
        t = _target[0]
        if t is None or _quiet.on:
            return orig(*args, **kwargs)
        token = group = None
        try:
            dist = _dist[0]
            pg = args[gi] if len(args) > gi else kwargs.get("group")
            peer = args[pi] if len(args) > pi else kwargs.get(peer_arg)
            group_peer = args[gpi] if len(args) > gpi else kwargs.get(group_peer_arg)
            if peer is None and group_peer is not None:
                peer = dist.get_global_rank(pg if pg is not None else dist.group.WORLD, group_peer)
            if peer is not None and pg != _dist[1]:
                me = dist.get_rank()
                lo, hi = (me, peer) if me < peer else (peer, me)
                group = f"{_label(pg)}:p2p:{lo}-{hi}"
                token = t.enter(group, op)
        except Exception:
            token = None
        return _call(orig, args, kwargs, t, token, group, False)

    return wrapper


def _call(
    orig: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    t: CommTiming,
    token: tuple[int, int] | None,
    group: str | None,
    async_op: bool,
) -> Any:
    """Call the original: a collective that raises counts as completed (it is not stuck),
    one that returns is finished now, or when its Work completes (``async_op``)."""
    try:
        result = orig(*args, **kwargs)
    except BaseException:
        _completed(t, token, group)
        raise
    if token is not None:
        _finish(t, token, group, result if async_op else None)
    return result


def _finish(t: CommTiming, token: tuple[int, int], group: str | None, work: Any) -> None:
    """Mark the collective completed: now for a synchronous call (or an async one whose
    Work has no future: counted as done rather than left looking stuck), else when its
    future completes (on the backend's thread)."""
    if group is None:
        return
    if work is not None:
        try:
            work.get_future().add_done_callback(lambda _f: _completed(t, token, group))
            return
        except Exception:
            pass
    _completed(t, token, group)


def _completed(t: CommTiming, token: tuple[int, int] | None, group: str | None) -> None:
    """Mark ``token`` completed, never raising: also for a call that raised (bad
    arguments, no process group, a timeout), which is not in flight, so it must not look
    like the collective a rank is stuck in."""
    if token is not None and group is not None:
        with contextlib.suppress(Exception):
            t.done(token, group)
