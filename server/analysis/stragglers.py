"""Online straggler detector: per-window evidence plus persistence and hysteresis.

Feed it the rank windows of a run as they complete; it returns the flags that opened or
closed. A flag opens after ``open_after`` (3) consecutive windows in which the same rank
(or host) is an outlier for the same cause, and closes after ``close_after`` (3)
consecutive clean windows, so one noisy window raises nothing and a flag does not flap.

A window in which a key has no data (no profiler fields for a compute key, the rank absent)
neither advances nor resets that key: "consecutive" counts windows with information. While
a host flag is open, the per-rank hits of that host are folded into it (they are the same
problem), so the per-rank keys of that host see clean windows.

Persistence: the detector's state is small (one record per rank/host currently flagged or
on a streak) and round-trips through :meth:`StragglerDetector.to_state` /
:meth:`StragglerDetector.from_state` as plain JSON-ready dicts, so the collector can store
it with the run and rebuild the detector on any replica. Replaying the windows from the
start also works (windows at or below the last processed index are ignored, so a replay of
an overlapping batch is harmless), but the state is cheaper.

Feed a window once it is complete (all ranks in, or a deadline passed): ranks missing from
it carry no information for that window.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from . import _format as fmt
from .peers import Hit, StragglerConfig, WindowVerdict, evaluate_window
from .types import Finding, RankWindow, Status

STATE_VERSION = 1


@dataclass(slots=True)
class _Track:
    """One key on a streak or flagged: the numbers needed to report and to close it."""

    key: str
    hit: Hit
    first_step: int
    first_window: int
    last_step: int
    last_window: int
    streak: int = 0
    clean: int = 0
    n_hits: int = 0
    is_open: bool = False
    cost_sum: float = 0.0
    step_sum: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "hit": self.hit.to_dict(),
            "first_step": self.first_step,
            "first_window": self.first_window,
            "last_step": self.last_step,
            "last_window": self.last_window,
            "streak": self.streak,
            "clean": self.clean,
            "n_hits": self.n_hits,
            "is_open": self.is_open,
            "cost_sum": self.cost_sum,
            "step_sum": self.step_sum,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> _Track:
        return cls(
            key=str(data["key"]),
            hit=Hit.from_dict(data["hit"]),
            first_step=int(data["first_step"]),
            first_window=int(data["first_window"]),
            last_step=int(data["last_step"]),
            last_window=int(data["last_window"]),
            streak=int(data["streak"]),
            clean=int(data["clean"]),
            n_hits=int(data["n_hits"]),
            is_open=bool(data["is_open"]),
            cost_sum=float(data["cost_sum"]),
            step_sum=float(data["step_sum"]),
        )


class StragglerDetector:
    """Stateful straggler detection for one run (see the module docstring)."""

    def __init__(self, run: str, config: StragglerConfig | None = None) -> None:
        self.run = run
        self.config = config or StragglerConfig()
        self._tracks: dict[str, _Track] = {}
        self._last_window: int | None = None

    @property
    def last_window(self) -> int | None:
        """Index of the last window processed (``None`` before the first)."""
        return self._last_window

    def update(self, windows: Iterable[RankWindow]) -> list[Finding]:
        """Process complete windows (any number, any order); return flags opened or closed.

        Windows with an index at or below the last one processed are ignored.
        """
        by_index: dict[int, list[RankWindow]] = defaultdict(list)
        for w in windows:
            by_index[w.window].append(w)
        events: list[Finding] = []
        for index in sorted(by_index):
            if self._last_window is not None and index <= self._last_window:
                continue
            events.extend(self.apply(evaluate_window(by_index[index], self.config)))
        return events

    def apply(self, verdict: WindowVerdict) -> list[Finding]:
        """Advance the persistence state by one window's verdict."""
        cfg = self.config
        open_hosts = {t.hit.hosts[0] for t in self._tracks.values() if t.is_open and t.hit.cause == "host"}
        hits = {k: h for k, h in verdict.hits.items() if h.cause == "host" or not set(h.hosts) & open_hosts}
        events: list[Finding] = []
        for key in sorted(hits):
            hit = hits[key]
            track = self._tracks.get(key)
            if track is None:
                track = _Track(
                    key=key,
                    hit=hit,
                    first_step=hit.first_step,
                    first_window=verdict.window,
                    last_step=hit.last_step,
                    last_window=verdict.window,
                )
                self._tracks[key] = track
            track.hit = hit
            track.streak += 1
            track.clean = 0
            track.n_hits += 1
            track.cost_sum += hit.cost_seconds
            track.step_sum += hit.step_time_s
            track.last_step = hit.last_step
            track.last_window = verdict.window
            if not track.is_open and track.streak >= cfg.open_after:
                track.is_open = True
                events.append(self._finding(track, "open"))
        for key in sorted(self._tracks):
            if key in hits or key not in verdict.observed:
                continue
            track = self._tracks[key]
            if not track.is_open:
                del self._tracks[key]  # the streak is broken
                continue
            track.clean += 1
            if track.clean >= cfg.close_after:
                events.append(self._finding(track, "closed"))
                del self._tracks[key]
        self._last_window = verdict.window
        return events

    def open_findings(self) -> list[Finding]:
        """The flags open now, with their latest evidence."""
        return [self._finding(t, "open") for _, t in sorted(self._tracks.items()) if t.is_open]

    def to_state(self) -> dict[str, Any]:
        """JSON-ready state; :meth:`from_state` rebuilds an equivalent detector."""
        return {
            "version": STATE_VERSION,
            "run": self.run,
            "config": self.config.to_dict(),
            "last_window": self._last_window,
            "tracks": [t.to_dict() for _, t in sorted(self._tracks.items())],
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> StragglerDetector:
        """Inverse of :meth:`to_state`."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported straggler state version {state.get('version')!r}")
        det = cls(str(state["run"]), StragglerConfig.from_dict(state["config"]))
        last = state.get("last_window")
        det._last_window = None if last is None else int(last)
        for raw in state["tracks"]:
            track = _Track.from_dict(raw)
            det._tracks[track.key] = track
        return det

    def _finding(self, track: _Track, status: Status) -> Finding:
        hit = track.hit
        cost = track.cost_sum / track.n_hits if track.n_hits else 0.0
        step = track.step_sum / track.n_hits if track.n_hits else 0.0
        ratio = cost / step if step > 0 else 0.0
        evidence = dict(hit.evidence)
        evidence.update(
            {
                "windows_flagged": float(track.n_hits),
                "first_window": float(track.first_window),
                "last_window": float(track.last_window),
                "mean_cost_s": cost,
            }
        )
        return Finding(
            kind="straggler",
            run=self.run,
            key=track.key,
            cause=hit.cause,
            ranks=hit.ranks,
            hosts=hit.hosts,
            first_step=track.first_step,
            last_step=track.last_step,
            status=status,
            evidence=evidence,
            cost_seconds=cost,
            cost_ratio=ratio,
            message=_message(hit, track, status, cost, ratio),
        )


_OPEN_VERB = {
    "compute": "is a compute straggler since step {first}",
    "data": "is a data straggler since step {first}",
    "link": "has a slow link since step {first}",
    "host": "is slow since step {first}",
    "host_stall": "stalls on the host since step {first}",
    "cpu_contention": "waits for CPU cores since step {first}",
}
_CLOSED_VERB = {
    "compute": "was a compute straggler from step {first} to {last}",
    "data": "was a data straggler from step {first} to {last}",
    "link": "had a slow link from step {first} to {last}",
    "host": "was slow from step {first} to {last}",
    "host_stall": "stalled on the host from step {first} to {last}",
    "cpu_contention": "waited for CPU cores from step {first} to {last}",
}


def _message(hit: Hit, track: _Track, status: Status, cost: float, ratio: float) -> str:
    """One sentence: who, what, since when, the evidence, and the cost."""
    host = hit.hosts[0]
    subject = f"Host {host}" if hit.cause == "host" else f"Rank {hit.ranks[0]} (host {host})"
    verbs = _OPEN_VERB if status == "open" else _CLOSED_VERB
    verb = verbs[hit.cause].format(first=fmt.step(track.first_step), last=fmt.step(track.last_step))
    cost_word = "costs" if status == "open" else "cost"
    return f"{subject} {verb}: {hit.detail}; {cost_word} {fmt.secs(cost)}/step ({fmt.pct(ratio)})."
