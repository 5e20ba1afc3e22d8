"""Which windows of a run are complete enough to analyse (a pure function).

A rank window may only be compared with its peers once every rank has reported it, or the
comparison is made with whoever happened to be on time. Window ``w`` (steps
``w * window_steps + 1 .. (w + 1) * window_steps``) is **complete** when every rank of the
run has reported a step past its end, and the profiler entry of every profiler window
that starts in it (the agent's ``profiles_through``: an entry is parsed on its own thread
and often rides on a later batch than its steps, and a window compared without it lacks
the compute times that name a compute straggler), or has finished (its final batch came
and it has not stepped since). A rank that never reports again (dead, or its agent lost) must not
stop the analysis of the others: a window that newer data has already passed (some rank
reported a later step) but that is still incomplete is analysed anyway ``grace_s`` after
a collector first saw it passed, without the missing rank. Those first sightings use the
collector's clock and are kept in the run's analysis state, so a replica that takes over
keeps the same deadlines. The last window with data is never analysed by grace while the
run may still be filling it; it is once every rank has finished.

Windows are analysed strictly in order, so the result is a prefix: the first window that
is neither complete nor past its grace stops the list.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ..storage.columns import window_of


class RankProgress(NamedTuple):
    """How far one rank has reported, and whether it has finished (final batch). A
    named tuple: one is built per rank per pass of every active run."""

    rank: int
    last_step: int
    final_step: int | None = None
    #: Through which step the rank's profiler entries are stored (None: no wait).
    profiles_through: int | None = None

    @property
    def finished(self) -> bool:
        """The rank closed its agent and has not stepped since."""
        return self.final_step is not None and self.final_step >= self.last_step

    @property
    def complete_through(self) -> int:
        """The last step whose window this rank has sent everything of: its steps and
        the profiles of the profiler windows among them."""
        if self.profiles_through is None:
            return self.last_step
        return min(self.last_step, self.profiles_through)


@dataclass(frozen=True, slots=True)
class Readiness:
    """The windows to analyse now, and the grace bookkeeping to store with the state."""

    windows: tuple[int, ...]
    pending: Mapping[int, float]
    by_grace: tuple[int, ...] = ()


def ready_windows(
    *,
    next_window: int,
    window_steps: int,
    world_size: int,
    ranks: Sequence[RankProgress],
    max_step: int,
    pending: Mapping[int, float],
    now: float,
    grace_s: float,
    limit: int,
) -> Readiness:
    """The windows from ``next_window`` on that can be analysed now (see the module docstring).

    ``max_step`` is the largest step any rank reported; ``pending`` maps windows already
    seen passed-but-incomplete to when they were first seen so. At most ``limit`` windows
    are returned (the rest wait for the next pass).
    """
    if max_step < 1 or window_steps < 1:
        return Readiness((), {})
    ws = window_steps
    last_window = window_of(max_step, ws)
    all_finished = bool(ranks) and all(r.finished for r in ranks)
    if len(ranks) >= world_size and ranks:
        done = [r.complete_through for r in ranks if not r.finished]
        # Windows below this index were reported past their end by every rank.
        complete_below = last_window + 1 if not done else min(done) // ws
    else:
        complete_below = 0  # some rank never reported: only grace (or its arrival) helps
    passed_below = last_window + 1 if all_finished else last_window

    out: list[int] = []
    by_grace: list[int] = []
    new_pending: dict[int, float] = {}
    stop = False
    for w in range(next_window, min(passed_below, next_window + limit)):
        if w < complete_below:
            if not stop:
                out.append(w)
            continue
        since = pending.get(w, now)
        new_pending[w] = since
        if not stop and now - since >= grace_s:
            out.append(w)
            by_grace.append(w)
            continue
        stop = True
    keep = {w: t for w, t in new_pending.items() if w not in out}
    return Readiness(tuple(out), keep, tuple(by_grace))
