"""Every value the schema accepts is storable, on both backends; what the database cannot
hold (NUL, wrong JSON types) is refused at the edge with a 422 naming the field.

Issue 15: ``cost.every`` of 2**31 and a NUL in ``profiles[].skipped`` answered 500 on
PostgreSQL, ``tokens_sum`` overflowed BIGINT after duplicated steps, and strings,
floats and booleans were coerced into integers and flags.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, select, text, update

from stepwatch import wire
from stepwatch_server.app import create_app
from stepwatch_server.settings import Settings
from stepwatch_server.storage.engine import make_engine
from stepwatch_server.storage.models import (
    INT32_MAX,
    INT64_MAX,
    IngestedBatch,
    ProfileWindow,
    RankWindow,
    Run,
)

from .. import pg
from ..payloads import payload, profile_entry


@pytest.fixture
def client(db_url: str, engine: Engine) -> Iterator[TestClient]:
    with TestClient(create_app(Settings(database_url=db_url, analysis_enabled=False), engine=engine)) as c:
        yield c


def _profiled(every: int) -> dict[str, Any]:
    entry = profile_entry(first_step=1, enter=[0.1, 0.6], end=[0.2, 0.7], ranks=(0,))
    entry["cost"]["every"] = entry["cost"]["next_every"] = every
    return payload(times=[0.5] * 4, profiles=[entry])


def _errors(r: Any) -> list[str]:
    return [".".join(str(p) for p in e["loc"]) for e in r.json()["errors"]]


def test_the_largest_value_of_each_bounded_column_is_stored(client: TestClient, engine: Engine) -> None:
    r = client.post("/api/v1/ingest", json=_profiled(INT32_MAX))
    assert r.status_code == 200, r.text
    with engine.connect() as conn:
        assert conn.execute(select(ProfileWindow.profile_every)).scalar_one() == INT32_MAX
    r = client.post("/api/v1/ingest", json=_profiled(INT32_MAX + 1))
    assert r.status_code == 422 and "profiles.0.cost.every" in _errors(r), r.text


def test_sums_saturate_instead_of_overflowing(client: TestClient, engine: Engine) -> None:
    """Duplicated steps under fresh batch ids add up (a restarted agent resends them);
    at the column's largest value the sum stays there and the batch is still stored."""
    first = payload(tokens=[2**40] * 4, padded=[2**40] * 4)
    assert client.post("/api/v1/ingest", json=first).status_code == 200
    with engine.begin() as conn:  # as if 2**23 such batches had been stored
        conn.execute(update(RankWindow).values(tokens_sum=INT64_MAX - 5, padded_tokens_sum=INT64_MAX - 5))
        conn.execute(
            text("UPDATE job_steps SET tokens = :v, ranks = :r"), {"v": INT64_MAX - 5, "r": INT32_MAX}
        )
    again = payload(tokens=[2**40] * 4, padded=[2**40] * 4)  # same steps, new batch id
    r = client.post("/api/v1/ingest", json=again)
    assert r.status_code == 200 and r.json()["stored"] is True, r.text
    with engine.connect() as conn:
        sums = conn.execute(select(RankWindow.tokens_sum, RankWindow.padded_tokens_sum)).all()
        steps = conn.execute(text("SELECT tokens, ranks FROM job_steps")).all()
    assert sums and all(tuple(s) == (INT64_MAX, INT64_MAX) for s in sums)
    assert steps and all(tuple(s) == (INT64_MAX, INT32_MAX) for s in steps)
    assert client.get("/api/v1/runs/test-run").status_code == 200


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda p: p["profiles"][0].update(skipped="another\x00profiler"), "profiles.0.skipped"),
        (lambda p: p["profiles"][0]["top_ops"][0].update(name="aten::\x00mm"), "profiles.0.top_ops.0.name"),
        (lambda p: p["convention"].update(formula="a\x00"), "convention.formula"),
        (lambda p: p["convention"].update(note="\x00"), "convention.note"),
        (lambda p: p["profiles"][0]["arrivals"][0].update(group="\x00"), "profiles.0.arrivals.0.group"),
    ],
    ids=["skipped", "top_op", "formula", "convention_extra", "group"],
)
def test_a_nul_in_body_text_is_refused_naming_the_field(
    client: TestClient, engine: Engine, mutate: Any, field: str
) -> None:
    p = _profiled(100)
    mutate(p)
    r = client.post("/api/v1/ingest", json=p)
    assert r.status_code == 422 and _errors(r) == [field], r.text
    assert "NUL" in r.json()["detail"]
    with engine.connect() as conn:
        assert conn.execute(select(Run.id)).first() is None  # nothing stored


def test_a_backslash_before_u0000_is_text_not_a_nul(client: TestClient, engine: Engine) -> None:
    """The body holds the bytes ``\\\\u0000`` (an escaped backslash, then ``u0000``): the
    NUL check scans further and must find no NUL in it."""
    p = _profiled(100)
    p["convention"].update(note="C:\\u0000")
    r = client.post("/api/v1/ingest", json=p)
    assert r.status_code == 200 and r.json()["stored"] is True, r.text
    with engine.connect() as conn:
        (convention,) = conn.execute(select(Run.convention)).one()
    assert convention["note"] == "C:\\u0000"


@pytest.mark.parametrize(
    "path", ["/api/v1/runs/%00", "/api/v1/runs/a%00b/series", "/api/v1/runs/a%00/ranks", "/runs/%00"]
)
def test_a_nul_in_the_run_path_is_refused(client: TestClient, path: str) -> None:
    r = client.get(path)
    assert r.status_code == 422 and _errors(r) == ["path.run"], r.text


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda p: p.update(schema_version=2.0), "schema_version"),
        (lambda p: p.update(schema_version=True), "schema_version"),
        (lambda p: p["steps"].update(tokens=["1"] * 4), "steps.tokens.0"),
        (lambda p: p["steps"].update(tokens=[True, False, True, True]), "steps.tokens.0"),
        (lambda p: p["steps"].update(tokens=[1.0] * 4), "steps.tokens.0"),
        (lambda p: p["rank"].update(rank="0"), "rank.rank"),
        (lambda p: p.update(final="yes"), "final"),
        (lambda p: p.update(final=1), "final"),
        (lambda p: p["steps"].update(first="1"), "steps.first"),
        (lambda p: p["steps"].update(time_s=["0.5"] * 4), "steps.time_s.0"),
    ],
    ids=[
        "version_float",
        "version_bool",
        "tokens_str",
        "tokens_bool",
        "tokens_float",
        "rank_str",
        "final_str",
        "final_int",
        "first_str",
        "time_str",
    ],
)
def test_wrong_json_types_are_not_coerced(
    client: TestClient, engine: Engine, mutate: Any, field: str
) -> None:
    p = payload()
    mutate(p)
    r = client.post("/api/v1/ingest", json=p)
    assert r.status_code == 422 and field in _errors(r), r.text
    with engine.connect() as conn:
        assert conn.execute(select(Run.id)).first() is None


@contextmanager
def _narrowed(pg_admin: str) -> Iterator[tuple[TestClient, Engine]]:
    """A collector over a fresh PostgreSQL database whose ``ranks.local_rank`` was narrowed
    to ``smallint`` behind its back: a schema-valid local rank over 32,767 is refused by
    the database itself."""
    from stepwatch_server.storage import migrate

    with pg.fresh_database(pg_admin) as url:
        migrate.upgrade(url)
        engine = make_engine(url)
        try:
            with engine.begin() as conn:
                conn.execute(text("ALTER TABLE ranks ALTER COLUMN local_rank TYPE smallint"))
            settings = Settings(database_url=url, analysis_enabled=False)
            with TestClient(create_app(settings, engine=engine)) as c:
                yield c, engine
        finally:
            engine.dispose()


def test_a_database_refusal_answers_422_and_is_counted(pg_admin: str) -> None:
    """If the schema and a column still disagree (here: a column narrowed behind the
    collector's back), the database's ``DataError`` refuses that batch with a 422, its
    neighbours are stored, and the refusal is counted. PostgreSQL only: SQLite has no
    column types to disagree with."""
    with _narrowed(pg_admin) as (c, _):
        bad = payload(run="narrow")
        bad["rank"]["local_rank"] = 40_000
        r = c.post("/api/v1/ingest", json=bad)
        assert r.status_code == 422 and _errors(r) == ["body"], r.text
        assert "smallint" in r.json()["detail"]
        assert c.post("/api/v1/ingest", json=payload(run="fine")).status_code == 200
        scrape = c.get("/metrics").text
    assert 'stepwatch_ingest_batches_total{outcome="unstorable"} 1.0' in scrape


def test_a_database_refusal_of_one_host_batch_entry_names_it_and_stores_its_neighbours(pg_admin: str) -> None:
    """The same refusal inside a host batch: the entries are stored one by one, the refused
    one answered 422 at ``batches.<i>``, the others stored and counted."""
    entries = [payload(run="narrow-host", rank=r, world=4) for r in range(3)]
    entries[1]["rank"]["local_rank"] = 40_000
    with _narrowed(pg_admin) as (c, engine):
        r = c.post(wire.HOST_BATCH_PATH, json={"batches": entries})
        assert r.status_code == 422 and _errors(r) == ["batches.1.body"], r.text
        assert "smallint" in r.json()["detail"]
        # Alone in its host batch (and in its group), it gets the same answer.
        r = c.post(wire.HOST_BATCH_PATH, json={"batches": [entries[1]]})
        assert r.status_code == 422 and _errors(r) == ["batches.0.body"], r.text
        scrape = c.get("/metrics").text
        with engine.connect() as conn:
            stored = set(conn.execute(select(IngestedBatch.batch_id)).scalars())
    assert stored == {entries[0]["batch_id"], entries[2]["batch_id"]}
    assert 'stepwatch_ingest_batches_total{outcome="unstorable"} 2.0' in scrape
    assert 'stepwatch_ingest_batches_total{outcome="stored"} 2.0' in scrape
