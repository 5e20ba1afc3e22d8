"""Which directives go into the answer to a rank's batch.

Every rank posts every window, so this is on the ingest path: a directive is read from
the database at most once per run per :data:`TTL_S` per collector process (one indexed
query for the run's live directives and the ranks that acknowledged them), and a rank's
answer is filtered from that in memory; a stale copy answers while it is read again, so
no answer but a run's first in a process waits for the database. Directives are rare: a
run with none costs one small query a second, not one per POST. A directive created on
another collector replica reaches the ranks within ``TTL_S``; a rank answered from a copy
older than its own ack gets the directive again and acknowledges it again (the agent
applies each id once). A config directive goes to a rank whose batch does not list it
among the configs its process applied or refused (the agent section's ``configs``), acked
or not: a restarted rank starts with an empty list and gets the run's live settings again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, cast

from sqlalchemy import Engine, Table, select

from stepwatch import wire

from ..storage.models import Directive, DirectiveAck
from .directives import wire_form

D = cast(Table, Directive.__table__)
ACK = cast(Table, DirectiveAck.__table__)
TTL_S = 1.0


@dataclass(frozen=True, slots=True)
class _Live:
    wire: dict[str, Any]
    kind: str
    ranks: frozenset[int] | None
    acked: frozenset[int]


class Deliveries:
    """The live directives of each run, cached per process (see the module docstring)."""

    def __init__(
        self, engine: Engine, *, ttl_s: float = TTL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._engine = engine
        self._ttl = ttl_s
        self._clock = clock
        self._cache: dict[int, tuple[float, list[_Live]]] = {}
        self._loading: dict[int, asyncio.Future[list[_Live]]] = {}
        self._refreshes: set[asyncio.Future[list[_Live]]] = set()  # held until done

    async def for_rank(
        self, run_id: int, rank: int, configs: Sequence[str] | None = None
    ) -> list[dict[str, Any]] | None:
        """The directives rank ``rank`` of run ``run_id`` still needs (None: none): the
        captures it has not acknowledged, and the configs its process has not applied
        (``configs``, as its batch reports them; None from an agent that does not report
        them: the configs it has not acknowledged)."""
        hit = self._cache.get(run_id)
        if hit is None:
            live = await self._load(run_id)  # the first batch of a run in this process
        else:
            live = hit[1]
            if self._clock() - hit[0] >= self._ttl and run_id not in self._loading:
                # Stale: answered from the copy, refreshed beside the answer.
                self._refreshes.add(task := asyncio.ensure_future(self._load(run_id)))
                task.add_done_callback(self._refreshes.discard)
        if not live:  # the common case: nothing asked of this run
            return None
        out = [
            d.wire
            for d in live
            if (d.ranks is None or rank in d.ranks)
            and (
                d.wire["id"] not in configs  # at most 16 ids: a list is as quick as a set
                if d.kind == "config" and configs is not None
                else rank not in d.acked
            )
        ][: wire.MAX_DIRECTIVES]
        return out or None

    async def _load(self, run_id: int) -> list[_Live]:
        """One load per run at a time: the ranks of a run post at about the same moment."""
        fut = self._loading.get(run_id)
        if fut is None:
            fut = asyncio.ensure_future(asyncio.to_thread(self.read, run_id))
            self._loading[run_id] = fut
            fut.add_done_callback(lambda _: self._loading.pop(run_id, None))
        live = await asyncio.shield(fut)
        self._cache[run_id] = (self._clock(), live)
        if len(self._cache) > 4096:  # runs that stopped posting
            oldest = sorted(self._cache, key=lambda r: self._cache[r][0])[:1024]
            for r in oldest:
                self._cache.pop(r, None)
        return live

    def read(self, run_id: int) -> list[_Live]:
        now = datetime.now(timezone.utc)
        with self._engine.connect() as conn:
            rows = conn.execute(
                select(D.c.id, D.c.kind, D.c.ranks, D.c.params)
                .where(D.c.run_id == run_id, D.c.expires_at > now)
                .order_by(D.c.id)
            ).all()
            if not rows:
                return []
            acked: dict[int, set[int]] = {r.id: set() for r in rows}
            for a in conn.execute(
                select(ACK.c.directive_id, ACK.c.rank).where(ACK.c.directive_id.in_(list(acked)))
            ):
                acked[a.directive_id].add(a.rank)
        return [
            _Live(
                wire=wire_form(r.kind, r.id, r.params),
                kind=r.kind,
                ranks=frozenset(r.ranks) if r.ranks is not None else None,
                acked=frozenset(acked[r.id]),
            )
            for r in rows
        ]

    def forget(self, run_id: int) -> None:
        """Drop a run's copy (this process created a directive for it)."""
        self._cache.pop(run_id, None)
