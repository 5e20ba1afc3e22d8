"""A hang diagnosed end to end over real HTTP, on SQLite and PostgreSQL.

Four real agents (their own sender threads, heartbeats included) report to a real
collector (uvicorn over loopback, its analysis worker and webhook running). The ranks
step with the communication hook's counters, then stop: ranks 0, 1 and 3 enter the next
step's all-reduces and never complete them, rank 2 never enters. The training threads
close no window from then on; only the heartbeats say where each rank is. The hang
event must name rank 2 as never entered, the collective and its sequence number, the
waiting ranks and since when, in the API, the web page, ``stepwatch top`` and the
webhook; it closes when the ranks step again. Bad heartbeats are refused, naming the
field, and store nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, func, select

import stepwatch
from stepwatch._env import detect
from stepwatch.config import AgentConfig
from stepwatch_server.storage.models import RankGroup, Run

from ..live import serve_in_thread
from ..payloads import payload
from ..wait import wait_until
from .test_webhook import Receiver, receiving

RANKS, BUCKETS, STEPS, STUCK = 4, 3, 12, 2
RUN = "hang-diag"
#: The collective the ranks stop in: the first of step STEPS + 1.
SEQ = STEPS * BUCKETS + 1


@pytest.fixture
def collector(db_url: str) -> Iterator[tuple[str, Receiver]]:
    rec = Receiver()
    with (
        receiving(rec) as hook,
        serve_in_thread(
            db_url,
            window_seconds=2.0,
            analysis_interval_s=0.1,
            analysis_grace_s=1.0,
            hang_floor_s=2.0,
            webhook_url=hook,
        ) as url,
    ):
        yield url, rec


def _agents(url: str) -> list[stepwatch.Stepwatch]:
    cfg = AgentConfig(
        run=RUN, url=url, send_interval_s=0.3, warmup_steps=0, profile_every=0, flush_timeout_s=5
    )
    return [
        stepwatch.Stepwatch(
            cfg, detect({}, rank=r, local_rank=r, world_size=RANKS, host=f"n{r}"), convention=None
        )
        for r in range(RANKS)
    ]


def _enter(sw: stepwatch.Stepwatch) -> list[Any]:
    return [sw.comm_timing.arrive("world", b, 4096) for b in range(BUCKETS)]


def _finish(sw: stepwatch.Stepwatch, tokens: list[Any]) -> None:
    for t in tokens:
        sw.comm_timing.done(t, "world")
    sw.step(tokens=64)


def _hang_events(url: str) -> list[dict[str, Any]]:
    return [e for e in httpx.get(f"{url}/api/v1/runs/{RUN}/events").json() if e["kind"] == "hang"]


def test_the_hang_names_the_rank_that_never_entered_and_the_ranks_waiting(
    collector: tuple[str, Receiver], engine: Engine
) -> None:
    url, hook = collector
    sws = _agents(url)
    try:
        for _ in range(STEPS):
            for sw in sws:
                _finish(sw, _enter(sw))
        for sw in sws:
            assert sw.flush(10.0)
        entered_at = time.time()
        waiting = {r: _enter(sws[r]) for r in range(RANKS) if r != STUCK}

        def diagnosed() -> dict[str, Any] | None:
            evs = [
                e for e in _hang_events(url) if (e["evidence"].get("collective") or {}).get("never_entered")
            ]
            return evs[0] if evs else None

        ev = wait_until(diagnosed, "a hang event with its diagnosis", timeout_s=60, every_s=0.1)
        assert (ev["key"], ev["status"], ev["ranks"], ev["hosts"]) == ("hang:run", "open", [STUCK], ["n2"])
        stuck = ev["evidence"]["collective"]
        assert {k: stuck[k] for k in ("group", "op", "seq", "never_entered", "waiting", "unconfirmed")} == {
            "group": "world",
            "op": "all_reduce",
            "seq": SEQ,
            "never_entered": [STUCK],
            "waiting": [0, 1, 3],
            "unconfirmed": [],
        }
        assert entered_at - 0.5 <= stuck["since"] <= time.time()
        when = time.strftime("%H:%M:%S", time.gmtime(stuck["since"]))
        clause = f"rank 2 never entered all_reduce #{SEQ} of group world; 3 ranks wait in it since {when} UTC"
        assert clause in ev["message"]
        # Only heartbeats carried the counters of the stuck step: no window closed since.
        with engine.connect() as conn:
            run_id = conn.execute(select(Run.id).where(Run.name == RUN)).scalar_one()
            rows = conn.execute(
                select(RankGroup.rank, RankGroup.entered, RankGroup.completed, RankGroup.heartbeat)
                .where(RankGroup.run_id == run_id)
                .order_by(RankGroup.rank)
            ).all()
        assert [tuple(r) for r in rows] == [
            (r, SEQ - 1 if r == STUCK else SEQ + BUCKETS - 1, SEQ - 1, 1) for r in range(RANKS)
        ]
        # Where people read hangs: the page, `stepwatch top`, the webhook.
        page = httpx.get(f"{url}/runs/{RUN}").text
        assert clause in page
        top = subprocess.run(
            [sys.executable, "-m", "stepwatch", "top", "--url", url, "--run", RUN, "--iterations", "1"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "COLUMNS": "400"},
        )
        assert top.returncode == 0, top.stderr
        assert "rank 2 never entered all_reduce" in top.stdout
        texts = wait_until(
            lambda: [b["text"] for b in hook.bodies if "never entered" in b.get("text", "")],
            "the webhook's diagnosed hang",
        )
        assert clause in texts[0] and "hang open" in texts[0]

        # The ranks step again: the hang closes.
        _finish(sws[STUCK], _enter(sws[STUCK]))
        for r, tokens in waiting.items():
            _finish(sws[r], tokens)
        for sw in sws:
            assert sw.flush(10.0)
        wait_until(
            lambda: [e for e in _hang_events(url) if e["status"] == "closed" and e["key"] == "hang:run"],
            "the hang to close",
            timeout_s=30,
        )
    finally:
        for sw in sws:
            sw.close(2.0)


def _comm(n: int, groups: list[dict[str, Any]]) -> dict[str, Any]:
    per_step: list[float | None] = [None] * n
    return {
        "version": 1,
        "arrive_s": per_step,
        "end_s": per_step,
        "sync_s": per_step,
        "cpu_s": per_step,
        "groups": groups,
    }


def test_a_diagnosis_that_comes_after_the_hang_opened_updates_it_and_tells_the_webhook_again(
    collector: tuple[str, Receiver],
) -> None:
    url, hook = collector
    stopped = time.time() - 30.0  # the run stopped long ago: the hang opens at once
    for r in range(RANKS):
        # Counters read while the ranks stepped (no heartbeat) show collectives in flight:
        # no evidence of where the run stopped.
        groups = [
            {"group": "world", "entered": 20 + r, "completed": 19, "op": "all_reduce", "since": stopped}
        ]
        body = payload(
            run=RUN, rank=r, world=RANKS, first=1, times=[0.5] * 8, wall_end=stopped, comm=_comm(8, groups)
        )
        assert httpx.post(f"{url}/api/v1/ingest", json=body).status_code == 200
    (ev,) = wait_until(lambda: _hang_events(url), "the hang to open")
    assert ev["key"] == "hang:run" and "collective" not in ev["evidence"]
    wait_until(lambda: [b for b in hook.bodies if "hang open" in b["text"]], "the webhook's hang")
    for r in range(RANKS):
        entered = 24 if r == 1 else 27
        groups = [
            {
                "group": "world",
                "entered": entered,
                "completed": 24,
                "op": "all_reduce",
                "since": time.time(),
            }
        ]
        beat = payload(
            run=RUN,
            rank=r,
            world=RANKS,
            first=9,
            times=[],
            wall_end=stopped,
            comm=_comm(0, groups) | {"idle_s": 30.0},
        )
        beat["heartbeat"] = True
        assert httpx.post(f"{url}/api/v1/ingest", json=beat).status_code == 200
    texts = wait_until(
        lambda: [b["text"] for b in hook.bodies if "never entered" in b["text"]],
        "the webhook's diagnosed hang",
    )
    assert "rank 1 never entered all_reduce #25 of group world; 3 ranks wait in it" in texts[0]
    (ev,) = _hang_events(url)  # the same event, now diagnosed
    assert ev["ranks"] == [1] and ev["evidence"]["collective"]["waiting"] == [0, 2, 3]
    assert len([b for b in hook.bodies if "never entered" in b["text"]]) == 1  # said once


@pytest.mark.parametrize(
    ("change", "field", "says"),
    [
        ({"steps": {"time_s": [0.5]}}, None, "a heartbeat carries no step: steps.time_s must be empty"),
        ({"comm": None}, None, "a heartbeat needs comm.groups"),
        ({"final": True}, None, "a heartbeat cannot be final"),
        ({"groups": [{"group": "world", "entered": 3, "completed": 3}] * 2}, "comm", "more than once"),
        (
            {"groups": [{"group": "world", "entered": 3, "completed": 3, "op": "allreduce"}]},
            "op",
            "all_reduce",
        ),
        ({"groups": [{"group": "", "entered": 3, "completed": 3}]}, "group", "at least 1 character"),
    ],
)
def test_a_bad_heartbeat_is_refused_naming_the_field_and_stores_nothing(
    collector: tuple[str, Receiver], engine: Engine, change: dict[str, Any], field: str | None, says: str
) -> None:
    url, _ = collector
    body = payload(run=RUN, first=5, times=[], wall_end=time.time())
    body["heartbeat"] = True
    body["comm"] = {
        "version": 1,
        "arrive_s": [],
        "end_s": [],
        "sync_s": [],
        "cpu_s": [],
        "groups": [
            {"group": "world", "entered": 3, "completed": 2, "op": "all_reduce", "since": time.time()}
        ],
    }
    good = dict(body)
    if "groups" in change:
        body["comm"] = {**body["comm"], "groups": change["groups"]}
    elif "steps" in change:
        body["steps"] = {**body["steps"], "time_s": [0.5], "data_wait_s": [0.0], "tokens": [1]}
        body["comm"] = {**body["comm"], **{k: [None] for k in ("arrive_s", "end_s", "sync_s", "cpu_s")}}
    else:
        body.update(change)
    r = httpx.post(f"{url}/api/v1/ingest", json=body)
    assert r.status_code == 422, r.text
    assert says in r.json()["detail"]
    if field is not None:  # a field's own error names it in its location
        assert any(field in map(str, e["loc"]) for e in r.json()["errors"]), r.json()["errors"]
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(RankGroup)).scalar() == 0
        assert conn.execute(select(func.count()).select_from(Run)).scalar() == 0
    # The heartbeat as the agent sends it is stored: counters, no step.
    assert httpx.post(f"{url}/api/v1/ingest", json=good).status_code == 200
    with engine.connect() as conn:
        (row,) = conn.execute(select(RankGroup)).all()
        assert (row.group_name, row.entered, row.completed, row.op, row.heartbeat) == (
            "world",
            3,
            2,
            "all_reduce",
            1,
        )
