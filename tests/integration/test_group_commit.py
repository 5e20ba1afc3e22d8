"""Group commit stores exactly what batch-by-batch storage stores.

The same batches (tags, padding, a profiled window, final batches without steps, a batch
id sent twice, two ranks' windows split across batches) are stored once one at a time
and once as one group, on each backend; every stored row must agree. And concurrent
submissions through the committer are grouped, each answered with its own outcome.
"""

from __future__ import annotations

import asyncio
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, select

from stepwatch_server.ingest.group_commit import GroupCommitter
from stepwatch_server.ingest.store import Ingestor
from stepwatch_server.schemas import IngestPayload
from stepwatch_server.storage import migrate
from stepwatch_server.storage.engine import make_engine
from stepwatch_server.storage.models import IngestedBatch, Rank, RankWindow

from .. import pg
from ..payloads import payload, profile_entry
from .test_scale_out import _same, _snapshot

PROFILE = profile_entry(first_step=9, enter=[0.2, 0.7, 1.2, 1.7], end=[0.3, 0.8, 1.3, 1.8], ranks=(0, 1, 2))


def _batches() -> list[IngestPayload]:
    raw: list[dict[str, Any]] = []
    for rank in range(3):
        raw.append(payload(rank=rank, world=3, first=1, times=[0.5, 0.6, 0.7], tags=["warmup", None, None]))
        raw.append(payload(rank=rank, world=3, first=4, times=[0.5] * 5, padded=[1024] * 5, tokens=[900] * 5))
        raw.append(
            payload(rank=rank, world=3, first=9, times=[0.55] * 4, profiles=[PROFILE] if rank == 1 else None)
        )
        raw.append(payload(rank=rank, world=3, first=13, times=[], final=True))
    raw.append(dict(raw[1]))  # a retry inside the same group
    return [IngestPayload.model_validate(p) for p in raw]


def _ranks(engine: Engine) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        cols = (Rank.rank, Rank.last_step, Rank.final_step, Rank.dropped_windows)
        return [tuple(r) for r in conn.execute(select(*cols).order_by(Rank.rank))]


def _profiles(engine: Engine) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        cols = (RankWindow.rank, RankWindow.window, RankWindow.profiled_steps, RankWindow.compute_s)
        q = select(*cols).where(RankWindow.profiled_steps.is_not(None)).order_by(RankWindow.rank)
        return [tuple(r) for r in conn.execute(q)]


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_one_group_stores_what_batch_by_batch_stores(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    with ExitStack() as stack:
        if backend == "sqlite":
            urls = [f"sqlite:///{tmp_path / name}.db" for name in ("one", "group")]
        else:
            admin: str = request.getfixturevalue("pg_admin")
            urls = [stack.enter_context(pg.fresh_database(admin)) for _ in range(2)]
        engines = []
        for url in urls:
            migrate.upgrade(url)
            engines.append(make_engine(url))
            stack.callback(engines[-1].dispose)
        one, group = (Ingestor(e, window_seconds=2.0) for e in engines)
        batches = _batches()
        singly = [one.store_many([b])[0] for b in batches]
        grouped = group.store_many(batches)
        assert singly == grouped == [True] * 12 + [False]
        _same(_snapshot(engines[0]), _snapshot(engines[1]))
        assert _ranks(engines[0]) == _ranks(engines[1]) == [(r, 12, 12, 0) for r in range(3)]
        assert _profiles(engines[0]) == _profiles(engines[1]) == [(1, 2, 4, pytest.approx(0.3))]


def test_concurrent_submissions_are_grouped_and_answered_each(engine: Engine) -> None:
    batches = _batches()
    groups: list[int] = []
    ingestor = Ingestor(engine, window_seconds=2.0)
    committer = GroupCommitter(ingestor.store_many, on_group=groups.append)

    async def submit_all() -> list[bool]:
        return list(await asyncio.gather(*(committer.submit(b) for b in batches)))

    results = asyncio.run(submit_all())
    assert sorted(results) == [False] + [True] * 12  # the retried id is stored once
    assert sum(groups) == len(batches) and len(groups) < len(batches), groups
    with engine.connect() as conn:
        assert len(conn.execute(select(IngestedBatch.batch_id)).all()) == 12


def test_binary_array_parameters_round_trip(pg_admin: str) -> None:
    import numpy as np
    import psycopg

    from stepwatch_server.storage import pg_arrays

    floats = np.array([0.0, 1.5, -2.25, 1e-300, 1e300, 0.1 + 0.2])
    ints = np.ma.array([1, -2, 2**62, 0, 1024], mask=[False, True, False, True, False])
    with psycopg.connect(pg_admin) as conn:
        pg_arrays.register(conn.adapters)
        row = conn.execute(
            "SELECT %s::float8[], %s::bigint[], %s::bigint[]",
            [
                pg_arrays.encode(floats),
                pg_arrays.encode(ints),
                pg_arrays.encode(np.ma.masked_all(3, dtype=int)),
            ],
        ).fetchone()
    assert row is not None
    assert row[0] == floats.tolist()  # bit for bit
    assert row[1] == [1, None, 2**62, None, 1024]
    assert row[2] == [None, None, None]
