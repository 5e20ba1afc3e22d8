"""Scoring: was the fault flagged, with the right cause and rank, after how long; false flags.

- **flagged**: the expected flag (its key, e.g. ``straggler:compute:rank=13``) opened.
- **cause and rank**: the *first* straggler flag that opened names the expected cause,
  rank(s) and host (a host flag may name the subset of the host's ranks that were flagged
  singly); for an MFU drop, the attribution names the breakdown component that was
  made to grow; for a hang of the whole job no rank can be named (in synchronous
  training every rank stops at the same collective), for a silent rank it is that rank.
- **to flag**: windows from the first faulty window to the one whose analysis opened
  the flag (1 = the first faulty window), or seconds from the last step before a hang.
- **false flags**: flags other than the expected one and its consequences (a slow rank
  slows the job, which the regression detector may rightly report); on clean runs,
  every flag is false.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .paths import Flag, Outcome

#: A hang must be flagged within its threshold plus this slack (agent send interval,
#: analysis interval, polling).
HANG_SLACK_S = 2.5


@dataclass(frozen=True)
class RunScore:
    """The score of one run of one scenario."""

    flagged: bool
    right: bool
    delay: float | None
    unit: str
    false_flags: int
    related: int
    goal: bool
    note: str


@dataclass(frozen=True)
class Row:
    """One line of the table: a scenario on one path, over one or more seeds."""

    scenario: str
    path: str
    runs: int
    flagged: int
    right: int
    delays: tuple[float, ...]
    unit: str
    goal: int
    false_flags: int
    related: int
    rank_windows: int
    job_windows: int
    clean: bool
    note: str


def _first_straggler(flags: Sequence[Flag]) -> Flag | None:
    stragglers = [f for f in flags if f.kind == "straggler" and f.opened_window is not None]
    return min(stragglers, key=lambda f: (f.opened_window or 0, f.key), default=None)


def score(o: Outcome) -> RunScore:
    exp = o.scenario.expect
    if exp is None:
        n = len(o.flags)
        note = o.flags[0].message if o.flags else ""
        return RunScore(False, False, None, "", n, 0, n == 0, note)
    target = [f for f in o.flags if f.key == exp.key]
    false = [f for f in o.flags if f.key != exp.key and f.key not in exp.related]
    related = [f for f in o.flags if f.key in exp.related]
    flagged = bool(target)
    fault = o.scenario.fault
    assert fault is not None
    delay: float | None = None
    unit = "windows"
    right = False
    if exp.kind == "straggler":
        first = _first_straggler(o.flags)
        if first is not None:
            ranks_ok = (
                set(first.ranks) <= set(exp.ranks) and bool(first.ranks)
                if exp.cause == "host"
                else first.ranks == exp.ranks
            )
            right = (
                first.key == exp.key and first.cause == exp.cause and ranks_ok and first.hosts == exp.hosts
            )
    elif exp.kind == "regression" and target:
        deltas = {k[len("delta_") :]: v for k, v in target[0].evidence.items() if k.startswith("delta_")}
        right = bool(deltas) and max(deltas, key=lambda c: deltas[c]) == exp.component
    elif exp.kind == "hang" and target:
        right = target[0].ranks == exp.ranks
        unit = "s"
    if target:
        t = target[0]
        if unit == "s":
            if t.opened_at is not None and o.fault_time is not None:
                delay = t.opened_at - o.fault_time
        elif t.opened_window is not None:
            delay = float(t.opened_window - fault.at + 1)
    if unit == "s":
        limit = (o.hang_threshold_s or 0.0) + HANG_SLACK_S
        in_time = delay is not None and delay <= limit
    else:
        in_time = delay is not None and exp.goal_windows is not None and delay <= exp.goal_windows
    goal = flagged and right and in_time and not false
    note = target[0].message if target else (false[0].message if false else "")
    return RunScore(flagged, right, delay, unit, len(false), len(related), goal, note)


def rows(outcomes: Sequence[Outcome]) -> list[Row]:
    """Group outcomes by (scenario, path) into table rows, in first-seen order."""
    groups: dict[tuple[str, str], list[Outcome]] = {}
    for o in outcomes:
        groups.setdefault((o.scenario.label(), o.path), []).append(o)
    out = []
    for (label, path), group in groups.items():
        scores = [score(o) for o in group]
        clean = group[0].scenario.expect is None
        out.append(
            Row(
                scenario=label,
                path=path,
                runs=len(group),
                flagged=sum(s.flagged for s in scores),
                right=sum(s.right for s in scores),
                delays=tuple(s.delay for s in scores if s.delay is not None),
                unit=scores[0].unit,
                goal=sum(s.goal for s in scores),
                false_flags=sum(s.false_flags for s in scores),
                related=sum(s.related for s in scores),
                rank_windows=sum(o.rank_windows for o in group),
                job_windows=sum(o.job_windows for o in group),
                clean=clean,
                note=next((s.note for s in scores if s.note), ""),
            )
        )
    return out
