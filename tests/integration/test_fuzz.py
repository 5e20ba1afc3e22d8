"""Schemathesis over the collector's own OpenAPI document.

Every documented operation gets generated requests, valid and invalid (negative data
generation: wrong types, out-of-range numbers, bad patterns, missing fields). The
collector must never answer 5xx, must answer only what it documents, and every 4xx must
carry a ``detail`` that names the problem (for 422: the field). Valid requests run on both
backends, since they reach the queries and the storage; invalid ones on SQLite, since
their answer is the request validation's, which runs before any database is touched (on
PostgreSQL too they cost the parallel phase 40 s for that same code). Examples per
operation are bounded (50, ``STEPWATCH_FUZZ_EXAMPLES``): about 20 s per backend and mode on
2 quiet cores, the longest tests of the parallel phase after mypy (dealt first to the
workers for that: ``LONG_FIRST`` in ``tests/conftest.py``).
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from sqlalchemy import Engine

from stepwatch_server.app import create_app
from stepwatch_server.reads.queries import SERIES_METRICS
from stepwatch_server.settings import Settings

from ..payloads import payload

EXAMPLES = {"positive": int(os.environ.get("STEPWATCH_FUZZ_EXAMPLES", 50))}
EXAMPLES["negative"] = EXAMPLES["positive"]


def _check(case: Any, seen: Counter[tuple[str, int]]) -> None:
    response = case.call()
    seen[(case.operation.label, response.status_code)] += 1
    case.validate_response(
        response,
        checks=[
            not_a_server_error,
            status_code_conformance,
            content_type_conformance,
            response_schema_conformance,
        ],
    )
    if 400 <= response.status_code < 500:
        body = response.json()
        detail = body.get("detail")
        assert isinstance(detail, str) and len(detail) >= 8, body
        if response.status_code == 422:
            assert ": " in detail and body["errors"], body  # "<field>: <what is wrong>"


@pytest.mark.parametrize(
    ("backend", "mode"),
    [
        ("sqlite", GenerationMode.POSITIVE),
        ("postgresql", GenerationMode.POSITIVE),
        ("sqlite", GenerationMode.NEGATIVE),
    ],
    ids=["sqlite-positive", "postgresql-positive", "sqlite-negative"],
    indirect=["backend"],
)
def test_fuzz_no_server_errors_and_every_4xx_names_the_problem(
    db_url: str, engine: Engine, mode: GenerationMode
) -> None:
    app = create_app(Settings(database_url=db_url), engine=engine)
    with TestClient(app) as client:  # a real run, so that GETs can reach the query code
        assert client.post("/api/v1/ingest", json=payload(run="test-run", world=4)).status_code == 200
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 9
    seen: Counter[tuple[str, int]] = Counter()
    for operation in operations:
        inputs = [*operation.path_parameters, *operation.query, *operation.body]
        if mode is GenerationMode.NEGATIVE and not inputs:
            continue  # nothing to make invalid (/healthz, /readyz, /metrics)
        strategies = [operation.as_strategy(generation_mode=mode)]
        if "{run}" in operation.path:  # and on a run that exists, to reach the queries
            strategies.append(
                operation.as_strategy(generation_mode=mode, path_parameters={"run": "test-run"})
            )
        for strategy in strategies:

            @given(case=strategy)
            @settings(
                max_examples=EXAMPLES[mode.value],
                deadline=None,
                suppress_health_check=list(HealthCheck),
                derandomize=True,
                database=None,
            )
            def fuzz(case: Any) -> None:
                _check(case, seen)

            fuzz()
    assert sum(n for (_, status), n in seen.items() if status < 500) == sum(seen.values())


@st.composite
def _layouts(draw: st.DrawFn) -> tuple[int, int, int]:
    world = draw(st.sampled_from([1, 2, 4, 8, 12, 64]))
    tp = draw(st.sampled_from([d for d in (1, 2, 4) if world % d == 0]))
    pp = draw(st.sampled_from([d for d in (1, 2) if (world // tp) % d == 0]))
    return world, tp, pp


_seconds = st.one_of(st.just(0.0), st.just(1e-300), st.floats(0.0, 1e6), st.just(1e6))
_tokens = st.one_of(st.just(0), st.integers(0, 2**40), st.just(2**40))


@st.composite
def _valid_batches(draw: st.DrawFn) -> dict[str, Any]:
    """Batches the schema accepts, with values at the edges of every bound."""
    world, tp, pp = draw(_layouts())
    n = draw(st.integers(1, 40))
    first = draw(st.one_of(st.integers(0, 100), st.just(2**53 - n)))
    p = payload(
        run=f"fz-{world}-{draw(st.sampled_from('ab'))}",  # a run has one world size
        rank=draw(st.integers(0, world - 1)),
        world=world,
        first=first,
        times=draw(st.lists(_seconds, min_size=n, max_size=n)),
        waits=draw(st.lists(_seconds, min_size=n, max_size=n)),
        tokens=draw(st.lists(_tokens, min_size=n, max_size=n)),
        padded=draw(st.none() | st.lists(_tokens, min_size=n, max_size=n)),
        tags=draw(
            st.none()
            | st.lists(st.sampled_from([None, "warmup", "checkpoint", "eval"]), min_size=n, max_size=n)
        ),
        host=draw(st.from_regex(r"\A[A-Za-z0-9._:-]{1,40}\Z")),
    )
    p["rank"]["layout"].update(tp=tp, pp=pp, dp=world // (tp * pp))
    p["steps"]["wall_end"] = draw(st.floats(1.0, 253_402_300_799.0))
    if draw(st.booleans()):
        p["convention"] = {
            **p["convention"],
            "flops_per_token": draw(st.floats(1e-300, 1e18).filter(lambda x: x > 0)),
            "peak_flops": draw(st.none() | st.floats(1e6, 1e20)),
            "note": draw(st.text(st.characters(exclude_characters="\x00"), max_size=40)),  # NUL: 422
        }
    if draw(st.booleans()):
        p["convention"] = None
    return p


@settings(
    max_examples=int(os.environ.get("STEPWATCH_FUZZ_EXAMPLES", 50)),
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
    database=None,
)
@given(batches=st.lists(_valid_batches(), min_size=1, max_size=4))
def _store_and_read(client: TestClient, batches: list[dict[str, Any]]) -> None:
    for p in batches:
        r = client.post("/api/v1/ingest", json=p)
        assert r.status_code == 200, r.text
    for run in {p["run"] for p in batches}:
        for path, params in [
            (f"/api/v1/runs/{run}", {}),
            (f"/api/v1/runs/{run}/ranks", {}),
            *[(f"/api/v1/runs/{run}/series", {"metric": m, "max_points": 7}) for m in SERIES_METRICS],
        ]:
            r = client.get(path, params=params)
            assert r.status_code in (200, 404), (path, params, r.text)
            assert r.status_code == 200 or "MFU" in r.json()["detail"] or "no peak" in r.json()["detail"]
    assert client.get("/api/v1/runs").status_code == 200


def test_fuzz_valid_batches_at_every_bound_are_stored_and_read_back(db_url: str, engine: Engine) -> None:
    """Schema-valid batches with extreme values: the storage and query code (PostgreSQL
    array literals, the numpy fold, sums and rates in SQL) must take all of them."""
    app = create_app(Settings(database_url=db_url), engine=engine)
    with TestClient(app) as client:
        _store_and_read(client)
