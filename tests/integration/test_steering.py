"""Steering over a real database (SQLite and PostgreSQL): captures and live settings asked
through the API reach the chosen ranks in the answers to their batches, once, and their
answers come back as stored state and an explanation; only admin tokens may steer (shown
on a real ``stepwatch serve`` over loopback).

The agent's side is in ``tests/unit/test_steering_agent.py`` (a real torch.profiler
capture in a training loop); here the ranks are played by payloads, so every
answer the collector must handle (acks, a capture's profiler entries, a miss) is sent on
purpose."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from stepwatch.demo import launch
from stepwatch_server.app import create_app
from stepwatch_server.settings import Settings
from stepwatch_server.storage.retention import prune

from ..payloads import payload, profile_entry

ADMIN, READ, WRITE = "admin-secret-0123456789", "read-secret-0123456789", "write-secret-0123456789"


@pytest.fixture
def client(db_url: str, engine: Engine) -> Iterator[TestClient]:
    app = create_app(Settings(database_url=db_url, window_seconds=2.0, analysis_enabled=False), engine=engine)
    with TestClient(app) as c:
        yield c


def _post(
    client: TestClient,
    rank: int,
    *,
    first: int,
    n: int = 8,
    agent_configs: list[str] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    body = payload(rank=rank, world=4, first=first, times=[0.1] * n, **extra)
    body["agent"]["send_interval_s"] = 1.0
    if agent_configs is not None:
        body["agent"]["configs"] = agent_configs
    r = client.post("/api/v1/ingest", json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _ack(
    client: TestClient,
    rank: int,
    first: int,
    acks: list[dict[str, Any]],
    agent_configs: list[str] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    body = payload(rank=rank, world=4, first=first, times=[0.1] * 8, **extra)
    body["agent"]["send_interval_s"] = 1.0
    if agent_configs is not None:
        body["agent"]["configs"] = agent_configs
    body["acks"] = acks
    r = client.post("/api/v1/ingest", json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _capture_entry(first: int, n: int, capture: str, mm_s: float) -> dict[str, Any]:
    e = profile_entry(
        first_step=first, enter=[0.1 * i for i in range(n)], end=[0.1 * i + 0.01 for i in range(n)]
    )
    e["capture"] = capture
    e["top_ops"] = [
        {"name": "aten::mm", "self_s": mm_s, "count": 12.0},
        {"name": "aten::add", "self_s": 0.01, "count": 4.0},
    ]
    return e


def test_a_capture_reaches_its_ranks_once_and_is_explained_from_their_answers(
    client: TestClient, engine: Engine
) -> None:
    for rank in range(4):
        assert "directives" not in _post(client, rank, first=1)  # nothing asked yet: the answer is as before
    r = client.post("/api/v1/runs/test-run/captures", json={"rank": 2, "steps": 3})
    assert r.status_code == 201, r.text
    cap = r.json()
    assert r.headers["location"] == f"/api/v1/runs/test-run/captures/{cap['id']}"
    assert cap["ranks"] == [0, 1, 2, 3]  # no communicator groups reported: its peers are the world
    # Ahead of the furthest reported step (8) by three send intervals (1 s) and 5 s of 0.1 s steps.
    assert cap["first_step"] == 8 + 80
    assert (cap["steps"], cap["status"], cap["reason"]) == (3, "pending", "open")
    ident = str(cap["id"])
    want = {"id": ident, "v": 1, "kind": "capture", "first_step": 88, "steps": 3}
    # The subject rank is asked for its raw trace too, up to the collector's cap.
    want |= {"trace_ranks": [2], "trace_max_bytes": 2 * 1024 * 1024}
    for rank in range(4):
        assert _post(client, rank, first=9)["directives"] == [want]
    # Acknowledged: no longer sent to that rank, still to the others.
    _ack(client, 0, 17, [{"id": ident, "state": "scheduled"}])
    _ack(client, 1, 17, [{"id": ident, "state": "scheduled"}])
    run_id = client.app.state.ingestor.cached("test-run").id  # type: ignore[attr-defined]
    client.app.state.deliveries.forget(run_id)  # type: ignore[attr-defined]  # as after its 1 s lifetime
    assert "directives" not in _post(client, 0, first=25)
    assert _post(client, 3, first=17)["directives"] == [want]
    # The answers: three ranks profiled the steps (rank 2's matmuls 1.6x), rank 3 missed them.
    s = cap["first_step"]
    for rank, mm in ((0, 0.010), (1, 0.011), (2, 0.0168)):
        _post(client, rank, first=s - 7 if rank else s - 15, n=16, profiles=[_capture_entry(s, 3, ident, mm)])
    miss = {"first_step": s, "n_steps": 0, "skipped": "previous window still being parsed", "capture": ident}
    _post(client, 3, first=25, n=24, profiles=[miss])
    got = client.get(f"/api/v1/runs/test-run/captures/{ident}").json()
    assert [(a["rank"], a["state"]) for a in got["answers"]] == [
        (0, "done"),
        (1, "done"),
        (2, "done"),
        (3, "missed"),
    ]
    # A late repeat of "scheduled" does not take back an outcome.
    _ack(client, 0, s + 9, [{"id": ident, "state": "scheduled"}])
    assert client.get(f"/api/v1/runs/test-run/captures/{ident}").json()["answers"][0]["state"] == "done"
    client.app.state.worker.run_once()  # type: ignore[attr-defined]
    got = client.get(f"/api/v1/runs/test-run/captures/{ident}").json()
    assert got["status"] == "done"
    result = got["result"]
    assert result["message"].startswith("rank 2: aten::mm 1.6x its peers' median"), result["message"]
    assert result["missed"] == {"3": "previous window still being parsed"}
    assert (result["captured"], result["ranks"], result["first_step"], result["steps"]) == (3, 4, s, 3)
    assert [c["id"] for c in client.get("/api/v1/runs/test-run/captures").json()] == [cap["id"]]


def test_a_capture_longer_than_the_budget_is_shortened_and_says_so(db_url: str, engine: Engine) -> None:
    app = create_app(
        Settings(database_url=db_url, window_seconds=2.0, analysis_enabled=False, capture_max_cost_s=0.5),
        engine=engine,
    )
    with TestClient(app) as client:
        entry = profile_entry(first_step=3, enter=[0.0, 0.1], end=[0.01, 0.11])
        entry["cost"] = {
            "window_s": 0.4, "on_thread_s": 0.1, "slowdown_s": 0.1, "parse_cpu_s": 0.2,
            "every": 100, "next_every": 100,
        }  # fmt: skip
        for rank in range(4):
            _post(client, rank, first=1, profiles=[entry])
        r = client.post("/api/v1/runs/test-run/captures", json={"all": True, "steps": 8})
        assert r.status_code == 201, r.text
        cap = r.json()
        # 0.2 s per profiled step: at most 2 steps fit in 0.5 s.
        assert (cap["steps"], cap["requested_steps"]) == (2, 8)
        assert cap["notes"] == [
            "shortened from 8 to 2 steps: 1.60 s estimated cost per rank over the budget of 0.5 s "
            "(STEPWATCH_CAPTURE_MAX_COST_S)"
        ]
        assert cap["estimated_cost_s"] == pytest.approx(0.4)


def test_new_live_settings_reach_every_rank_and_show_as_requested_and_applied(client: TestClient) -> None:
    for rank in range(4):
        _post(client, rank, first=1)
    bad = client.put("/api/v1/runs/test-run/config", json={"settings": {"send_interval_s": 0.01}})
    assert bad.status_code == 422
    assert "send_interval_s=0.01 is outside [0.5, 3600]" in bad.text and "settings" in bad.text
    assert (
        client.put("/api/v1/runs/test-run/config", json={"settings": {"profile_every": 1}}).status_code == 422
    )
    r = client.post("/api/v1/runs/test-run/captures", json={"rank": 1, "all": True})
    assert r.status_code == 422 and "exactly one of rank, ranks, host or all" in r.text
    r = client.post("/api/v1/runs/test-run/captures", json={"rank": 7})
    assert r.status_code == 422 and "rank 7 is not a running rank" in r.text
    r = client.put("/api/v1/runs/test-run/config", json={"settings": {"send_interval_s": 2}})
    assert r.status_code == 202, r.text
    ident = str(r.json()["id"])
    want = [{"id": ident, "v": 1, "kind": "config", "settings": {"send_interval_s": 2.0}}]
    for rank in range(4):
        assert _post(client, rank, first=9)["directives"] == want
    for rank in range(3):
        _ack(client, rank, 17, [{"id": ident, "state": "applied", "settings": {"send_interval_s": 2.0}}])
    (state,) = client.get("/api/v1/runs/test-run").json()["config"]
    assert (state["settings"], state["ranks"], state["applied"], state["pending"]) == (
        {"send_interval_s": 2.0},
        None,
        3,
        [3],
    )
    assert state["in_force"]["0"] == {"send_interval_s": 2.0}
    # A newer config for the whole run replaces it: only the newer one is live.
    r2 = client.put("/api/v1/runs/test-run/config", json={"settings": {"send_interval_s": 5}})
    assert [c["id"] for c in client.get("/api/v1/runs/test-run/config").json()] == [r2.json()["id"]]
    # A newer config keeps the older one's settings it does not change.
    r3 = client.put("/api/v1/runs/test-run/config", json={"settings": {"profile_every": 500}})
    (live,) = client.get("/api/v1/runs/test-run/config").json()
    assert live["id"] == r3.json()["id"] and live["settings"] == {
        "send_interval_s": 5.0,
        "profile_every": 500.0,
    }
    # An ack for a directive never issued is ignored; one reporting settings the agent
    # started with (below what a directive may ask) is stored as reported.
    _ack(client, 3, 25, [{"id": "999999", "state": "applied"}])
    ident3 = str(live["id"])
    _ack(client, 3, 33, [{"id": ident3, "state": "applied", "settings": {"send_interval_s": 0.25}}])
    (live,) = client.get("/api/v1/runs/test-run/config").json()
    assert (live["applied"], live["in_force"]) == (1, {"3": {"send_interval_s": 0.25}})


def test_a_restarted_rank_gets_the_live_settings_again(client: TestClient) -> None:
    """Acks are per rank, a process's settings are not: a rank whose batch does not list a
    live config among those its process applied (a new process) is sent it again."""
    for rank in range(2):
        _post(client, rank, first=1)
    ident = str(
        client.put("/api/v1/runs/test-run/config", json={"settings": {"send_interval_s": 2}}).json()["id"]
    )
    want = [{"id": ident, "v": 1, "kind": "config", "settings": {"send_interval_s": 2.0}}]
    run_id = client.app.state.ingestor.cached("test-run").id  # type: ignore[attr-defined]
    applied = [{"id": ident, "state": "applied", "settings": {"send_interval_s": 2.0}}]
    for rank in range(2):
        assert _post(client, rank, first=9, agent_configs=[])["directives"] == want
        _ack(client, rank, 17, applied, agent_configs=[ident])
    client.app.state.deliveries.forget(run_id)  # type: ignore[attr-defined]  # as after its 1 s lifetime
    assert "directives" not in _post(client, 0, first=25, agent_configs=[ident])
    # Rank 1 restarted from a checkpoint: a new process that has applied nothing yet.
    assert _post(client, 1, first=9, agent_configs=[])["directives"] == want
    # An agent that does not report its configs (older than the field) goes by its ack.
    assert "directives" not in _post(client, 1, first=25)


def test_a_capture_of_some_ranks_reaches_only_them_and_a_miss_by_ack_is_explained(client: TestClient) -> None:
    for rank in range(4):
        _post(client, rank, first=1, host="node-a" if rank < 2 else "node-b")
    r = client.post("/api/v1/runs/test-run/captures", json={"host": "node-b", "steps": 2})
    assert r.status_code == 201, r.text
    cap = r.json()
    ident = str(cap["id"])
    assert cap["ranks"] == [2, 3]
    # A second capture of some of the same ranks starts after the first one's steps (one
    # profiler window at a time on a rank); one of other ranks need not wait.
    second = client.post("/api/v1/runs/test-run/captures", json={"ranks": [3]}).json()
    assert second["first_step"] == cap["first_step"] + cap["steps"] + 1
    other = client.post("/api/v1/runs/test-run/captures", json={"ranks": [0]}).json()
    assert other["first_step"] == cap["first_step"]
    assert "directives" not in _post(client, 1, first=9, host="node-a")
    assert [d["id"] for d in _post(client, 2, first=9, host="node-b")["directives"]] == [ident]
    # A rank it did not ask cannot answer for it.
    _ack(client, 1, 17, [{"id": ident, "state": "missed", "reason": "forged"}], host="node-a")
    # Rank 2 captured, rank 3 missed by its ack alone (no profiler entry): explained anyway.
    entry = _capture_entry(cap["first_step"], 2, ident, 0.012)
    entry["arrivals"][0]["ranks"] = [2, 3]
    _post(client, 2, first=17, n=32, profiles=[entry], host="node-b")
    _ack(client, 3, 17, [{"id": ident, "state": "missed", "reason": "too late"}], host="node-b")
    client.app.state.worker.run_once()  # type: ignore[attr-defined]
    got = client.get(f"/api/v1/runs/test-run/captures/{ident}").json()
    assert [(a["rank"], a["state"]) for a in got["answers"]] == [(2, "done"), (3, "missed")]
    assert got["status"] == "done" and got["result"]["missed"] == {"3": "too late"}
    assert got["result"]["message"] == "1 of 2 ranks captured"


def test_a_finished_run_takes_no_directive(client: TestClient) -> None:
    for rank in range(4):
        _post(client, rank, first=1, final=True)
    for method, path, body in (
        ("POST", "captures", {"all": True}),
        ("PUT", "config", {"settings": {"send_interval_s": 2}}),
    ):
        r = client.request(method, f"/api/v1/runs/test-run/{path}", json=body)
        assert r.status_code == 409, r.text
        assert "every rank finished" in r.json()["detail"]
    assert client.get("/api/v1/runs/test-run/captures").json() == []
    assert client.post("/api/v1/runs/nope/captures", json={"all": True}).status_code == 404


def test_only_admin_tokens_steer_a_real_collector(tmp_path: Path) -> None:
    """A real ``stepwatch serve`` over loopback, with write, read and admin tokens; then
    with write and read tokens only, where nothing may steer."""
    tokens = {"STEPWATCH_WRITE_TOKENS": f"w={WRITE}", "STEPWATCH_READ_TOKENS": f"r={READ}"}
    db = f"sqlite:///{tmp_path / 'auth.db'}"
    env = {**tokens, "STEPWATCH_ADMIN_TOKENS": f"a={ADMIN}"}
    with (
        launch.collector(db, log_path=str(tmp_path / "a.log"), env=env) as col,
        httpx.Client(base_url=col.url) as c,
    ):
        for rank in range(4):
            body = payload(rank=rank, world=4, times=[0.1] * 8)
            assert c.post("/api/v1/ingest", json=body, headers=_bearer(WRITE)).status_code == 200
        path = "/api/v1/runs/test-run/captures"
        assert c.post(path, json={"all": True}).status_code == 401
        for token in (WRITE, READ):
            r = c.post(path, json={"all": True}, headers=_bearer(token))
            assert r.status_code == 403 and "STEPWATCH_ADMIN_TOKENS" in r.json()["detail"]
            body = {"settings": {"send_interval_s": 2}}
            assert c.put("/api/v1/runs/test-run/config", json=body, headers=_bearer(token)).status_code == 403
        # The command line says which token it needs.
        cli = [sys.executable, "-m", "stepwatch", "capture", "test-run", "--all", "--url", col.url]
        out = subprocess.run([*cli, "--token", READ], capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and "admin (STEPWATCH_ADMIN_TOKENS) tokens" in out.stderr, out.stderr
        out = subprocess.run(
            [*cli, "--token", ADMIN, "--wait", "0"], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0 and "on 4 rank(s) [0, 1, 2, 3]" in out.stdout, out.stderr
        assert c.get(path, headers=_bearer(ADMIN)).status_code == 200  # an admin may read
        assert len(c.get(path, headers=_bearer(READ)).json()) == 1
    # Tokens configured but no admin token: nothing steers.
    with (
        launch.collector(db, log_path=str(tmp_path / "b.log"), env=tokens) as col,
        httpx.Client(base_url=col.url) as c,
    ):
        for token in (WRITE, READ):
            r = c.post("/api/v1/runs/test-run/captures", json={"all": True}, headers=_bearer(token))
            assert r.status_code == 403


def _bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def test_the_subject_rank_uploads_its_raw_trace_and_a_person_downloads_it(client: TestClient) -> None:
    for rank in range(4):
        _post(client, rank, first=1)
    cap = client.post("/api/v1/runs/test-run/captures", json={"rank": 1, "steps": 2}).json()
    path = f"/api/v1/runs/test-run/captures/{cap['id']}/traces"
    raw = json.dumps({"traceEvents": [{"ph": "X", "name": "aten::mm", "ts": 1, "dur": 2}]}).encode()
    packed = gzip.compress(raw)
    gz = {"content-type": "application/gzip"}
    assert client.put(f"{path}/1", content=packed, headers=gz).status_code == 204
    r = client.put(f"{path}/0", content=packed, headers=gz)  # a rank it did not ask
    assert r.status_code == 403 and "did not ask rank 0 for its trace" in r.json()["detail"]
    r = client.put(f"{path}/1", content=raw, headers=gz)
    assert r.status_code == 422 and "must be gzipped" in r.text
    assert (
        client.put("/api/v1/runs/test-run/captures/999/traces/1", content=packed, headers=gz).status_code
        == 404
    )
    got = client.get(f"{path}/1")
    assert got.status_code == 200 and got.headers["content-type"] == "application/gzip"
    assert gzip.decompress(got.content) == raw and "attachment" in got.headers["content-disposition"]
    assert client.get(f"{path}/0").status_code == 404
    (listed,) = client.get("/api/v1/runs/test-run/captures").json()
    assert listed["traces"] == [{"rank": 1, "size": len(packed)}]


def test_a_trace_over_the_cap_is_refused_and_old_traces_are_pruned(db_url: str, engine: Engine) -> None:
    settings = Settings(database_url=db_url, analysis_enabled=False, capture_max_bytes=64)
    with TestClient(create_app(settings, engine=engine)) as client:
        for rank in range(4):
            _post(client, rank, first=1)
        cap = client.post("/api/v1/runs/test-run/captures", json={"rank": 1}).json()
        path = f"/api/v1/runs/test-run/captures/{cap['id']}/traces/1"
        big = gzip.compress(bytes(range(256)) * 64)
        r = client.put(path, content=big, headers={"content-type": "application/gzip"})
        assert r.status_code == 422 and "at most 64 (STEPWATCH_CAPTURE_MAX_BYTES)" in r.text
        small = gzip.compress(b"{}")
        assert (
            client.put(path, content=small, headers={"content-type": "application/gzip"}).status_code == 204
        )
        storage = client.app.state.ingestor.storage  # type: ignore[attr-defined]
    assert prune(storage, trace_days=1.0, now=time.time() + 3600).traces_deleted == 0
    assert prune(storage, trace_days=1.0, now=time.time() + 2 * 86400).traces_deleted == 1
