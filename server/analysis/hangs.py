"""Hangs: no step from a rank, or from the whole run, for longer than a threshold.

The threshold is ``max(k * median step time, floor_s)`` (defaults k = 10, floor 60 s): ten
ordinary steps is long enough that a checkpoint or an evaluation pass rarely trips it on
jobs with long steps, and the floor keeps a 2 s-step job from paging after 20 s of a
routine checkpoint. Before the run's step time is known (only warm-up steps so far) the
threshold is ``startup_s`` (default: the floor; the collector's is 10 min): a first step
takes as long as compilation, lazy initialisation and the first bucket rebuild take, on
a loaded machine many ordinary steps, and no silence then says more than that the run
is starting (NVRx keeps the same two timeouts, initial and subsequent).

Checking is stateless: call :func:`check_hang` on a timer with the time each rank last
reported a step; a hang is open while the check returns it, closed
when it stops returning it.

In synchronous training one stuck rank stops every rank at the next collective, so a
whole-run hang is reported once, naming the ranks that stopped first (those behind the
others by step number when known, else by time): they are the likely cause, the rest are
waiting for them. Per-rank flags are returned only while the run as a whole still makes
progress (a rank, or its agent, went silent while the others step): some rank reported
more than a threshold after the silent one went quiet. Ranks whose last reports are
closer than that (windows close a send interval apart) stopped together: no per-rank
flag for the first of them, which would name a rank that is only first to be late.

With the ranks' collective counters (``collectives``, see :mod:`.stuck_collectives`)
the run-level flag names the collective the run is stuck in, the ranks that never
entered it (they are the flag's ranks) and the ranks waiting in it since when. The
counters also settle a case the silence alone cannot: one rank silent past the
threshold while its peers' last batches are younger is a hang of the whole run, not of
that rank, when the peers' heartbeats show them waiting in a collective it never
entered; it is reported as such at once, not as a silent rank of a run still stepping.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from . import _format as fmt
from .stuck_collectives import GroupCounters, StuckCollective, describe, stuck_collectives
from .types import Finding


def hang_threshold_s(
    median_step_s: float | None, k: float = 10.0, floor_s: float = 60.0, startup_s: float | None = None
) -> float:
    """``max(k * median_step_s, floor_s)``; ``max(startup_s, floor_s)`` while no step time
    is known (``startup_s`` None: the floor)."""
    if median_step_s is None or median_step_s <= 0:
        return max(floor_s, startup_s or 0.0)
    return max(k * median_step_s, floor_s)


def check_hang(
    now: float,
    last_step_time_by_rank: Mapping[int, float],
    median_step_s: float | None,
    k: float = 10.0,
    floor_s: float = 60.0,
    *,
    run: str = "",
    host_by_rank: Mapping[int, str] | None = None,
    last_step_by_rank: Mapping[int, int] | None = None,
    collectives: Sequence[GroupCounters] = (),
    live_ranks: Sequence[int] | None = None,
    startup_s: float | None = None,
) -> list[Finding]:
    """Flags for a hung run (one) or for silent ranks of a run still stepping.

    ``now`` and the last-step times are in the same clock (epoch seconds). A rank hangs
    when ``now - last > threshold`` (strictly longer). ``collectives``: the ranks' latest
    group counters (empty: no diagnosis); ``live_ranks``: the ranks that have not
    finished (default: every rank given), the only ones that can be stuck.
    """
    if not last_step_time_by_rank:
        return []
    threshold = hang_threshold_s(median_step_s, k, floor_s, startup_s)
    hosts = host_by_rank or {}
    steps = last_step_by_rank or {}
    silent = {r: now - t for r, t in last_step_time_by_rank.items()}
    run_silent = min(silent.values())
    evidence_base = {
        "threshold_s": threshold,
        "median_step_s": median_step_s or 0.0,
        "k": k,
        "floor_s": floor_s,
    }
    live = set(silent) if live_ranks is None else set(live_ranks)
    # Counters count once read half a threshold after the rank's last step (no healthy
    # rank goes five median steps without finishing one).
    stuck = stuck_collectives(collectives, sorted(silent), threshold / 2) if collectives else []
    # A rank missing without a heartbeat may only not have sent it yet (heartbeats of
    # one stop arrive over a few send intervals): named once the others have waited
    # longer than the threshold, by which time a live agent has sent one.
    stuck = [s for s in stuck if not s.unconfirmed or (s.since is not None and now - s.since > threshold)]
    culprit = stuck[0] if stuck else None
    # Every live rank is either missing from the stuck collective or waiting in it.
    blocked = culprit is not None and live <= set(culprit.never_entered) | set(culprit.waiting)
    if run_silent > threshold or (blocked and max(silent.values()) > threshold):
        return [_run_hang(run, silent, run_silent, threshold, evidence_base, hosts, steps, stuck)]
    out = []
    # A rank is silent "while the run steps" when another rank reported more than a
    # threshold after it went quiet; ranks that stopped within a threshold of each
    # other stopped together, and the run-level verdict follows within a threshold.
    for rank in sorted(r for r, s in silent.items() if s > threshold and s - run_silent > threshold):
        host = hosts.get(rank)
        last_step = steps.get(rank, 0)
        where = f" (host {host})" if host else ""
        out.append(
            Finding(
                kind="hang",
                run=run,
                key=f"hang:rank={rank}",
                cause=None,
                ranks=(rank,),
                hosts=(host,) if host else (),
                first_step=last_step,
                last_step=last_step,
                status="open",
                evidence={**evidence_base, "silent_s": silent[rank]},
                cost_seconds=silent[rank],
                cost_ratio=1.0,
                message=(
                    f"Rank {rank}{where} has not reported a step for {fmt.duration(silent[rank])} "
                    f"(threshold {fmt.duration(threshold)}) while the run still steps; "
                    f"last step {fmt.step(last_step)}."
                ),
            )
        )
    return out


def _run_hang(
    run: str,
    silent: Mapping[int, float],
    run_silent: float,
    threshold: float,
    evidence_base: Mapping[str, float],
    hosts: Mapping[int, str],
    steps: Mapping[int, int],
    stuck: Sequence[StuckCollective] = (),
) -> Finding:
    """One flag for the whole run, naming the ranks that never entered the collective the
    others wait in, or else the ranks that stopped first."""
    if stuck:
        return _stuck_run_hang(run, silent, run_silent, threshold, evidence_base, hosts, steps, stuck)
    known = {r: steps[r] for r in silent if r in steps}
    if len(known) == len(silent):
        lowest = min(known.values())
        first = sorted(r for r, s in known.items() if s == lowest)
    else:
        # Without step numbers, the ranks that went silent more than one step time earlier.
        oldest = max(silent.values())
        slack = max(evidence_base["median_step_s"], 1e-9)
        first = sorted(r for r, s in silent.items() if s >= oldest - slack)
    if len(first) == len(silent):
        first = []  # all stopped together: no rank stands out
    if first:
        shown = ", ".join(str(r) for r in first[:8]) + (" ..." if len(first) > 8 else "")
        who = f"rank{'s' if len(first) > 1 else ''} {shown} stopped first"
        if steps and len(known) == len(silent):
            who += f" (at step {fmt.step(min(steps.values()))})"
    else:
        who = "all ranks stopped together"
    name = f"Run {run}" if run else "The run"
    return _run_finding(
        run,
        tuple(first),
        hosts,
        steps,
        evidence={**evidence_base, "silent_s": run_silent, "ranks_silent": float(len(silent))},
        cost_seconds=run_silent,
        message=(
            f"{name} has made no step for {fmt.duration(run_silent)} "
            f"(threshold {fmt.duration(threshold)}); {who}."
        ),
    )


def _run_finding(
    run: str,
    ranks: tuple[int, ...],
    hosts: Mapping[int, str],
    steps: Mapping[int, int],
    *,
    evidence: dict[str, float],
    cost_seconds: float,
    message: str,
    collective: Mapping[str, object] | None = None,
) -> Finding:
    """The run-level hang flag (key ``hang:run``): its steps span the ranks' last ones."""
    return Finding(
        kind="hang",
        run=run,
        key="hang:run",
        cause=None,
        ranks=ranks,
        hosts=tuple(sorted({hosts[r] for r in ranks if r in hosts})),
        first_step=min(steps.values()) if steps else 0,
        last_step=max(steps.values()) if steps else 0,
        status="open",
        evidence=evidence,
        cost_seconds=cost_seconds,
        cost_ratio=1.0,
        message=message,
        collective=collective,
    )


def _stuck_run_hang(
    run: str,
    silent: Mapping[int, float],
    run_silent: float,
    threshold: float,
    evidence_base: Mapping[str, float],
    hosts: Mapping[int, str],
    steps: Mapping[int, int],
    stuck: Sequence[StuckCollective],
) -> Finding:
    """The run-level flag with its diagnosis: ``stuck[0]`` is the most telling group."""
    s = stuck[0]
    name = f"Run {run}" if run else "The run"
    return _run_finding(
        run,
        s.never_entered,
        hosts,
        steps,
        evidence={
            **evidence_base,
            "silent_s": run_silent,
            "ranks_silent": float(len(silent)),
            "stuck_groups": float(len(stuck)),
        },
        cost_seconds=max(silent.values()),
        message=(
            f"{name} has hung: {describe(s)}; no step for {fmt.duration(max(silent.values()))} "
            f"(threshold {fmt.duration(threshold)})."
        ),
        collective=s.to_dict(),
    )
