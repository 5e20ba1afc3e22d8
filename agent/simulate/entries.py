"""Simulated profiler windows: the payload's v2 ``profiles`` entry of each rank.

The real agent turns a Chrome trace into an entry with
:func:`stepwatch.profiler._entry.build_entry`; the simulator has no trace, so it builds the
two things that function derives from one (the per-step breakdown and the collectives
placed in their steps) from the timing model and hands them to the same
:func:`~stepwatch.profiler._entry.assemble_entry`. The collector then stores them by the
path production uses, including the wait/transfer split from arrival times.

Per profiled step ``j`` of rank ``r`` (the window's first ``profile_steps`` steps), the
window means of :class:`~.model.RankTiming` are scaled by ``f = step_j / step`` so the
five parts sum to the step time, as the schema requires. Every communicator group of the
rank runs one collective per step, entered when the rank's compute and loader wait are
done (``step start + f * (compute + overlapped + data wait)``); it ends one per-step
transfer of that group after its last member entered. The collector's
``last arrival - own arrival`` is then the model's wait for the slowest member, and
``end - last arrival`` its transfer. In pure data parallel the world is one group and
each rank's own transfer ends its all-reduce (an agent timing its own sends).
"""

from __future__ import annotations

from typing import Any

from ..profiler._entry import assemble_entry
from ..profiler.breakdown import StepBreakdown
from ..profiler.trace import CollectiveRecord
from .model import TimingModel, WindowTimings

#: Steps per simulated profiler window (the schema's maximum is 16; the agent defaults to 2).
PROFILE_STEPS = 16
#: The collective each communicator type runs per step.
GROUP_OPS = {"dp": "all_reduce", "tp": "all_reduce", "cp": "all_gather", "pp": "send_recv"}
DEFAULT_GROUP = "0"


def profile_entries(
    model: TimingModel, wt: WindowTimings, t0: float, *, profile_steps: int = PROFILE_STEPS
) -> dict[int, dict[str, Any]]:
    """Rank -> its profiler entry for the first ``profile_steps`` steps of ``wt``.

    ``t0`` is the Unix time the window's first step started (all ranks start a step
    together: their step boundaries are the synchronous job's).
    """
    topo = model.topology
    k = max(1, min(profile_steps, wt.n_steps))
    step = [r.compute_s + r.comm_overlapped_s + r.comm_exposed_s + r.data_wait_s + r.idle_s for r in wt.ranks]
    reporting = [r for r in range(topo.world) if r not in wt.silent]
    starts_us: list[float] = []
    t = 0.0
    for j in range(k):
        starts_us.append(t)
        t += wt.step_time_s[j] * 1e6
    # Per step j: rank -> (scale, arrival µs).
    scale = [
        [wt.step_time_s[j] / step[r] if step[r] > 0 else 0.0 for r in range(topo.world)] for j in range(k)
    ]
    arrival = [
        [
            starts_us[j]
            + scale[j][r]
            * (wt.ranks[r].compute_s + wt.ranks[r].comm_overlapped_s + wt.ranks[r].data_wait_s)
            * 1e6
            for r in range(topo.world)
        ]
        for j in range(k)
    ]
    records: dict[int, list[tuple[int, CollectiveRecord]]] = {r: [] for r in reporting}
    if topo.group_types:
        for (gtype, gid), members in sorted(topo.groups.items()):
            ranks = tuple(sorted(members))
            for j in range(k):
                last = max(arrival[j][m] for m in members)
                for m in members:
                    if m not in records:
                        continue
                    transfer_us = scale[j][m] * wt.ranks[m].group_transfer_s.get(gtype, 0.0) * 1e6
                    enter = arrival[j][m]
                    records[m].append(
                        (j, _record(GROUP_OPS[gtype], enter, last + transfer_us - enter, gid, ranks))
                    )
    else:
        for j in range(k):
            last = max(arrival[j])
            for m in reporting:
                transfer_us = scale[j][m] * wt.ranks[m].comm_transfer_s * 1e6
                enter = arrival[j][m]
                records[m].append(
                    (j, _record("all_reduce", enter, last + transfer_us - enter, DEFAULT_GROUP, None))
                )
    numbers = [wt.first_step + j for j in range(k)]
    out: dict[int, dict[str, Any]] = {}
    for r in reporting:
        rt = wt.ranks[r]
        parts = [
            StepBreakdown(
                step_s=wt.step_time_s[j],
                compute_s=rt.compute_s * scale[j][r],
                comm_overlapped_s=rt.comm_overlapped_s * scale[j][r],
                comm_exposed_s=rt.comm_exposed_s * scale[j][r],
                data_wait_s=rt.data_wait_s * scale[j][r],
                idle_s=rt.idle_s * scale[j][r],
            )
            for j in range(k)
        ]
        recs = sorted(records[r], key=lambda jr: (jr[1].start_us, jr[1].group_name or ""))
        out[r] = assemble_entry(
            numbers=numbers, device="cuda", parts=parts, collectives=recs, base_us=t0 * 1e6, t0_us=0.0
        )
    return out


def _record(
    op: str, start_us: float, dur_us: float, group: str, ranks: tuple[int, ...] | None
) -> CollectiveRecord:
    return CollectiveRecord(
        op=op,
        start_us=start_us,
        dur_us=max(0.0, dur_us),
        bytes=None,
        group_name=group,
        group_size=len(ranks) if ranks is not None else None,
        group_ranks=ranks,
        seq=None,
    )
