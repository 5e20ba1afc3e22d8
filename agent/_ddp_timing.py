"""Always-on timing of DDP's own (C++) gradient all-reduce, at three Python calls a step
(``sw.watch(ddp)``, the default; ``per_bucket=True`` registers the per-bucket comm hook).

Why not a communication hook: any Python comm hook, torch's own ``allreduce_hook`` as
much as stepwatch's per-bucket one (``_comm_timing.comm_hook``), cost 4-5% of the step's
CPU on 4 gloo ranks sharing 2 cores against DDP's C++ reduction (``benchmarks.
comm_timing``, pooled over three runs), where issue 11's budget is 1%: the reducer
calls into Python for every bucket on the training thread and every bucket's completion
runs a Python ``then()`` on a backend thread. What a straggler detector needs of a step
is less than a bucket-by-bucket record: when this rank's gradients were all ready (its
*arrival* at the step's last all-reduce) and when the all-reduces had all ended; their
difference, the *sync* time, is long on a rank that waited for its peers and short on
the one they waited for.

Both instants come from autograd's final callbacks, with DDP left on its built-in
reduction. One post-accumulate-grad hook on one of DDP's parameters queues a callback
for the end of the backward pass (``queue_callback``). DDP's reducer queues its own,
which waits for every bucket's all-reduce (``finalize_backward``), when its last bucket
is ready, which is never before a parameter of its buckets accumulated its gradient: so
ours is queued first and runs first, when the graph is done and every bucket has been
launched (the arrival; the training thread's CPU clock is read there too). It queues a
second callback, which runs after DDP's, once the all-reduces have ended (the end).
Callbacks queued by a callback run in the same backward (the engine allows it for this).

The end read there is late by what the training thread did after DDP's wait returned:
waking up (on loaded shared cores, milliseconds on the run queue) and copying the buckets
into the gradients. That noise, not the collective, hid a compute straggler in 2 of 3 of
the suite's runs when this timing was first tried; so the end is taken back by the
thread's CPU time plus run-queue wait since the arrival (``_sched.ThreadBusy``: its CPU
clock and Linux schedstat's run-queue wait): what is left is the time the thread slept
in DDP's wait, which ends when the last all-reduce does. Elsewhere than Linux the end
stays as read. Two approximations, both small next to what they replace: DDP waits and
copies bucket by bucket, so copying an early bucket while a later all-reduce still runs
is taken off too (the end comes out early by that copy); and a wait for the GIL counts as
sleep (the sender thread holds it for microseconds at a time).

Per step, then, one bucket slot of :class:`~stepwatch._comm_timing.CommTiming` holds the
step's arrival and end, and the group's collective sequence counts one all-reduce per
step (entered at the arrival, completed at the end): a hang diagnosis names the rank that
never finished its backward, and the ranks that wait in the reduction. What this leaves
out, by design: durations per bucket (the profiler window has them, and
``stepwatch.comm_hook`` times every bucket where its cost is acceptable), and steps in
which the anchor parameter got no gradient (an unused parameter under
``find_unused_parameters``). Backward passes under ``ddp.no_sync()`` reduce nothing and
are not timed.

CUDA: as for the hook, the callbacks also record device events on the current stream
(which autograd synchronised with the backward's streams before the callbacks, and DDP's
finalisation with its all-reduces), read back lazily by the sender.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from ._comm_timing import CommTiming, _perf, _start_device, group_label
from ._sched import ThreadBusy


def time_reduction(ddp: Any, timing: CommTiming) -> bool:
    """Time DDP's gradient all-reduce of ``ddp`` once per step into ``timing``; the model
    keeps DDP's built-in reduction. Returns whether it was installed (False: no parameter
    takes a gradient, or this torch has no post-accumulate-grad hooks)."""
    from torch.autograd import Variable

    params = getattr(ddp, "_module_parameters", None)
    if params is None:
        params = list(ddp.module.parameters())
    params = [p for p in params if p.requires_grad]
    if not params or not hasattr(params[0], "register_post_accumulate_grad_hook"):
        return False
    anchor = params[0]
    group = group_label(getattr(ddp, "process_group", None))
    #: What DDP all-reduces per step: every gradient once (its buckets hold them all).
    nbytes = sum(p.numel() * p.element_size() for p in params)
    queue = Variable._execution_engine.queue_callback
    #: The arrival's token, device end event and the thread's busy nanoseconds
    #: (:class:`ThreadBusy`), for the end callback.
    pending: list[Any] = [None, None, None, 0]
    busy = ThreadBusy()
    #: Device events or the host clock only: decided once, at the first arrival.
    device: list[bool | None] = [None]

    # Each callback runs inside ``loss.backward()``: an exception would raise there, so
    # none leaves them (only the timing is lost).
    def ended() -> None:
        token, end_event, busy_then, tid = pending
        pending[0] = pending[1] = pending[2] = None
        with contextlib.suppress(Exception):
            # The end without the thread's own work since the arrival (DDP's copy of the
            # buckets into the gradients) and its waits for a core (its wake-up): the
            # collective ended when the thread's sleep in DDP's wait did.
            busy_now = busy.read() if tid == threading.get_native_id() else None
            now = _perf()
            at = None if busy_then is None or busy_now is None else now - (busy_now - busy_then) * 1e-9
            timing.ended(token, group, end_event, at)

    def arrived() -> None:
        try:
            if device[0] is None:
                device[0] = False  # a failure here leaves the host clock
                device[0] = _start_device(timing, anchor)
            token = timing.arrive(group, 0, nbytes)
            if token is None:
                return
            end_event = None
            if device[0]:
                with contextlib.suppress(Exception):
                    end_event = timing.device_arrival(token[1])
            pending[0], pending[1], pending[2] = token, end_event, busy.read()
            pending[3] = threading.get_native_id()
            queue(ended)
        except Exception:
            return

    def grad_ready(_param: Any) -> None:
        if ddp.require_backward_grad_sync:  # under no_sync() DDP reduces nothing
            with contextlib.suppress(Exception):
                queue(arrived)

    anchor.register_post_accumulate_grad_hook(grad_ready)
    timing.per_bucket = False
    return True
