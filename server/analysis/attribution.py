"""Which part of the step moved: the attribution of a job-wide regression.

A window's breakdown comes from one of two measurements (:func:`.pipeline.window_sample`
picks it, the same way for every window of a run):

- the **always-on timing** of every step (the agent's DDP hook, staged in
  ``step_timings``), along the step's critical path (its last arriver,
  :func:`.pipeline.timing_means`): data wait (loader), exposed communication (the
  transfer at the step's last collective; the other ranks' wait for the last arriver is
  not communication), and the rest of the step (``compute_s``: forward, backward and the
  host time between collectives), with the training thread's CPU time (``cpu_s``) beside it;
- the **profiler's breakdown** when only profiled windows have one: compute, exposed
  communication, data wait and idle measured from the trace.

With the always-on timing, the rest of the step is split into compute and idle by the CPU
time, because on a host shared with other work (or a rank that sleeps) the rest grows
without any more work done. At a fixed share of a core, more on-CPU work lengthens the
rest by the same fraction as it lengthens the CPU time; so the part of the rest's growth
that the CPU time's relative growth explains is compute, and what is left is idle (the
training thread off the CPU: a stall, a sleep, other load on the host). Attribution then
names the part whose time per step grew most and says what did not move, e.g. "compute
+0.05 s/step; data wait unchanged".
"""

from __future__ import annotations

from collections.abc import Mapping

from . import _format as fmt

#: Breakdown components that add up to the step time, with the words a person reads.
COMPONENTS: Mapping[str, str] = {
    "compute_s": "compute",
    "comm_exposed_s": "exposed communication",
    "data_wait_s": "data wait",
    "idle_s": "idle",
}
#: Per-step means a baseline and a regression keep: the components and the CPU time.
MEANS: tuple[str, ...] = (*COMPONENTS, "cpu_s")


def deltas(current: Mapping[str, float], baseline: Mapping[str, float]) -> dict[str, float]:
    """Per-component change (current - baseline, seconds per step) of the components both
    have; with the always-on timing (CPU time, no profiler idle) the rest's growth is split
    into compute and idle by the CPU time (see the module docstring)."""
    out = {c: current[c] - baseline[c] for c in COMPONENTS if c in current and c in baseline}
    cpu_now, cpu_base = current.get("cpu_s"), baseline.get("cpu_s")
    rest = out.get("compute_s")
    if rest is None or "idle_s" in out or cpu_now is None or not cpu_base or rest <= 0:
        return out
    rest_base = baseline["compute_s"]
    grew = rest / rest_base if rest_base > 0 else float("inf")
    explained = max(0.0, min(1.0, (cpu_now / cpu_base - 1.0) / grew)) if grew > 0 else 1.0
    out["compute_s"] = rest * explained
    out["idle_s"] = rest * (1.0 - explained)
    return out


def attribute(changes: Mapping[str, float], unchanged_s: float) -> str:
    """Name the breakdown component whose time grew most, and say what did not move.

    ``changes`` maps component to (regression mean - baseline mean) in seconds per step;
    a change smaller than ``unchanged_s`` reads "unchanged".
    """
    if not changes:
        return "no time breakdown to attribute it"
    thr = max(unchanged_s, 1e-6)
    top = max(changes, key=lambda c: changes[c])
    if changes[top] < thr:
        return "no breakdown component grew (tokens per step or FLOPs may have changed)"
    parts = [f"{COMPONENTS[top]} {fmt.signed_secs(changes[top])}/step"]
    for comp in sorted(changes, key=lambda c: -abs(changes[c])):
        if comp != top and abs(changes[comp]) >= thr and len(parts) < 3:
            parts.append(f"{COMPONENTS[comp]} {fmt.signed_secs(changes[comp])}/step")
    # Say what did not move, data wait first: it is the first thing people suspect.
    unchanged = [
        COMPONENTS[c]
        for c in ("data_wait_s", "comm_exposed_s", "compute_s")
        if c in changes and abs(changes[c]) < thr
    ]
    if unchanged:
        parts.append(f"{unchanged[0]} unchanged")
    return "; ".join(parts)


def top_component(changes: Mapping[str, float]) -> str | None:
    """The component whose time grew most (``None`` without a breakdown)."""
    return max(changes, key=lambda c: changes[c]) if changes else None
