"""The fold of a group against a plain per-step reference: one row per key, each column
by its merge rule, rows in key order.

``fold.py`` vectorises the group (sort by key, then ``reduceat``), so its rows are checked
here against the obvious Python loop over every step of every batch, for random groups:
several runs with their own window sizes, batches of one rank in the same window, steps
with and without padded tokens and tags, ranks that do not count tokens, final batches
without steps. (The storage tests compare the two backends, which share this fold, and the
job-step totals; this is where the per-rank windows meet a reference.)
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepwatch.wire import TAG_CODES
from stepwatch_server.ingest import fold, store
from stepwatch_server.schemas.ingest import IngestPayload
from stepwatch_server.storage import columns, rollups

from ..payloads import payload

TAGS = [None, *sorted(TAG_CODES)]
T0 = 1_800_000_000.0


@st.composite
def groups(draw: st.DrawFn) -> tuple[list[IngestPayload], list[int], list[int]]:
    window_steps = draw(st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=2))
    worlds = [draw(st.sampled_from([(2, 1), (4, 1), (4, 2)])) for _ in window_steps]  # (world, tp)
    payloads, run_ids, sizes = [], [], []
    for _ in range(draw(st.integers(1, 12))):
        r = draw(st.integers(0, len(window_steps) - 1))
        world, tp = worlds[r]
        n = draw(st.integers(0, 10))
        times = draw(st.lists(st.integers(1, 64), min_size=n, max_size=n))
        body = payload(
            run=f"fold-{r}",
            rank=draw(st.integers(0, world - 1)),
            world=world,
            first=draw(st.integers(0, 40)),
            times=[t / 64 for t in times],
            waits=[t / 256 for t in times],
            tokens=draw(st.lists(st.integers(0, 4096), min_size=n, max_size=n)),
            padded=draw(st.lists(st.integers(0, 8192), min_size=n, max_size=n))
            if draw(st.booleans())
            else None,
            tags=draw(st.lists(st.sampled_from(TAGS), min_size=n, max_size=n))
            if draw(st.booleans())
            else None,
            wall_end=T0 + draw(st.integers(0, 1000)),
            final=n == 0,
        )
        body["rank"]["layout"] = {"dp": world // tp, "tp": tp, "pp": 1, "cp": 1, "ep": 1}
        body["rank"]["counts_tokens"] = body["rank"]["rank"] % tp == 0  # one rank per data-parallel group
        payloads.append(IngestPayload.model_validate(body))
        run_ids.append(r + 1)
        sizes.append(window_steps[r])
    return payloads, run_ids, sizes


def _reference(
    payloads: list[IngestPayload], run_ids: list[int], sizes: list[int]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Rank-window and job-step rows from a loop over every step, sorted by key."""
    windows: dict[tuple[int, int, int], dict[str, Any]] = {}
    jobs: dict[tuple[int, int], dict[str, Any]] = {}
    for p, run_id, ws in zip(payloads, run_ids, sizes, strict=True):
        s = p.steps
        n = len(s.time_s)
        for j in range(n):
            step, t, w, tok = s.first + j, s.time_s[j], s.data_wait_s[j], s.tokens[j]
            pad = s.padded_tokens[j] if s.padded_tokens is not None else None
            tag = TAG_CODES.get(s.tags[j] or "", 0) if s.tags is not None else 0
            end = s.wall_end - sum(s.time_s[j + 1 :])
            win = windows.setdefault(
                (run_id, p.rank.rank, (max(step, 1) - 1) // ws),
                defaultdict(
                    float, first_step=step, last_step=step, step_time_min=t, step_time_max=t, wall_end=0.0
                ),
            )
            win["first_step"], win["last_step"] = min(win["first_step"], step), max(win["last_step"], step)
            win["n_steps"] += 1
            win["step_time_sum"] += t
            win["step_time_min"], win["step_time_max"] = (
                min(win["step_time_min"], t),
                max(win["step_time_max"], t),
            )
            win["data_wait_sum"] += w
            win["tokens_sum"] += tok
            if pad is not None:
                win["padded_tokens_sum"] = win.get("padded_tokens_sum", 0) + pad
            win["wall_end"] = max(win["wall_end"], s.wall_end)
            job = jobs.setdefault((run_id, step), defaultdict(float, step_time_max=t, data_wait_max=w, tag=0))
            counts = p.rank.counts_tokens
            job["ranks"] += 1
            job["token_ranks"] += int(counts)
            job["step_time_sum"] += t
            job["step_time_max"], job["data_wait_max"] = (
                max(job["step_time_max"], t),
                max(job["data_wait_max"], w),
            )
            job["tokens"] += tok if counts else 0
            if pad is not None:
                job["padded_tokens"] = job.get("padded_tokens", 0) + (pad if counts else 0)
            job["tag"] = max(job["tag"], tag)
            job["wall_end"] = max(job.get("wall_end", end), end)
    win_rows = [
        {"run_id": k[0], "rank": k[1], "window": k[2], "padded_tokens_sum": None, **v}
        for k, v in sorted(windows.items())
    ]
    job_rows = [{"run_id": k[0], "step": k[1], "padded_tokens": None, **v} for k, v in sorted(jobs.items())]
    return win_rows, job_rows


def _rows(cols: columns.Columns) -> list[dict[str, Any]]:
    names = list(cols)
    n = len(cols[names[0]]) if names else 0
    out = []
    for i in range(n):
        row = {}
        for name in names:
            v = cols[name][i]
            row[name] = None if v is np.ma.masked else v.item() if isinstance(v, np.generic) else v
        out.append(row)
    return out


def _same(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert len(got) == len(want), (got, want)
    for g, w in zip(got, want, strict=True):
        for name, value in g.items():
            if isinstance(value, float):
                assert value == pytest.approx(w[name], rel=1e-12, abs=1e-9), (name, g, w)
            else:
                assert value == w[name], (name, g, w)


@settings(max_examples=300, deadline=None)
@given(groups())
def test_a_folded_group_is_the_per_step_reference_by_every_rule(
    group: tuple[list[IngestPayload], list[int], list[int]],
) -> None:
    payloads, run_ids, sizes = group
    rows = fold.fold(payloads, run_ids, sizes)
    windows, jobs = _reference(payloads, run_ids, sizes)
    _same(_rows(rows.windows), windows)
    _same(_rows(rows.job_steps), jobs)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 3), st.integers(0, 300), st.integers(0, 140)), min_size=1, max_size=6)
)
def test_the_buckets_a_group_locks_before_folding_are_those_of_its_folded_steps(
    spans: list[tuple[int, int, int]],
) -> None:
    """Ingest locks a group's job-step buckets (64 steps each) from its batches' step
    spans, before the fold (``ingest/store.py``); they are exactly the buckets of the
    rows it then writes: none missing (a merge outside the lock), none extra (a wait for
    nothing). Spans start anywhere from step 0 and cross bucket edges."""
    payloads = [
        IngestPayload.model_validate(payload(run=f"r{r}", first=first, times=[0.5] * n, final=n == 0))
        for r, first, n in spans
    ]
    run_ids = [r for r, _, _ in spans]
    rows = fold.fold(payloads, run_ids, [8] * len(spans))
    folded = rollups.touched(rows.job_steps["run_id"], rows.job_steps["step"]) if rows.job_steps else []
    assert rollups.buckets_of(store.step_spans(payloads, run_ids)) == folded
