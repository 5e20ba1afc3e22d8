"""Group commit: the batches that arrive while one transaction is being written are
written together in the next one, and each request is answered after the commit that
holds its batch.

Thousands of ranks post windows of the same steps at about the same time. Written one
transaction per batch, each would update the same ``job_steps`` rows and wait for the
previous commit's lock and fsync. Grouping turns N upserts of a hot row into one and N
fsyncs into one, with no added latency when the collector is idle (a lone batch is
written at once; the group grows only while the writer is busy). Durability is unchanged:
no request gets its 2xx before its batch is committed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from sqlalchemy.exc import DataError, IntegrityError

from ..schemas.ingest import IngestPayload

log = logging.getLogger("stepwatch_server")
StoreMany = Callable[[Sequence[IngestPayload], Sequence[str | None]], list[bool]]
#: Each batch's outcome: True if it was new, False if stored before, or the exception the
#: database refused it with when stored alone (its neighbours stored).
Outcome = bool | Exception
#: One request's batches, its write token, and the one future its answer waits on.
Item = tuple[Sequence[IngestPayload], str | None, "asyncio.Future[list[Outcome]]"]


class GroupCommitter:
    """Funnels concurrent ``submit`` calls of one event loop into ``store_many`` calls,
    one at a time, on a worker thread (the event loop never waits for the database)."""

    def __init__(
        self,
        store_many: StoreMany,
        *,
        max_steps: int = 200_000,
        on_group: Callable[[int], None] | None = None,
    ) -> None:
        self._store_many = store_many
        self._on_group = on_group
        self._max_steps = max_steps
        self._pending: list[Item] = []
        self._writer: asyncio.Task[None] | None = None

    async def submit(self, payload: IngestPayload, owner: str | None = None) -> bool:
        """Store one batch with whatever else is waiting; True if it was new. ``owner``
        names the write token (recorded on a run this batch creates)."""
        (outcome,) = await self.submit_many([payload], owner)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def submit_many(self, payloads: Sequence[IngestPayload], owner: str | None = None) -> list[Outcome]:
        """Store one request's batches (a host batch) with whatever else is waiting, all
        in the same group; each batch's :data:`Outcome`, in order. One future for the
        request, not one per batch: a host batch's entries were a task, a shielded future
        and a turn of the event loop each. A batch the database refuses (``DataError``,
        ``IntegrityError``) is its outcome, its neighbours stored; raises if the whole
        group failed otherwise (the database away)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[list[Outcome]] = loop.create_future()
        self._pending.append((payloads, owner, fut))
        if self._writer is None or self._writer.done():
            self._writer = loop.create_task(self._drain())
        # A client that hangs up cancels its wait, not the write (retries are idempotent).
        return await asyncio.shield(fut)

    def _take(self) -> list[Item]:
        steps, n = 0, 0
        for payloads, _, _ in self._pending:
            steps += sum(len(p.steps.time_s) for p in payloads)
            n += 1
            if steps >= self._max_steps:
                break
        group, self._pending = self._pending[:n], self._pending[n:]
        return group

    async def _drain(self) -> None:
        while self._pending:
            group = self._take()
            payloads = [p for batch, _, _ in group for p in batch]
            owners = [o for batch, o, _ in group for _ in batch]
            if self._on_group is not None:
                self._on_group(len(payloads))
            try:
                results = await asyncio.to_thread(self._store_many, payloads, owners)
            except (IntegrityError, DataError) as exc:
                if len(payloads) == 1:  # that batch's own refusal, answered as its outcome
                    _resolve_outcomes(group[0], [exc])
                    continue
                # One bad batch must not fail its neighbours: write them one by one.
                log.warning("group of %d batches failed (%s); storing one by one", len(payloads), exc)
                for batch, owner, fut in group:
                    outcomes: list[Outcome] = []
                    for p in batch:
                        try:
                            (result,) = await asyncio.to_thread(self._store_many, [p], [owner])
                        except Exception as one_exc:
                            outcomes.append(one_exc)
                        else:
                            outcomes.append(result)
                    _resolve_outcomes((batch, owner, fut), outcomes)
                continue
            except Exception as exc:  # database away: every batch of the group gets the error (503)
                _fail(group, exc)
                continue
            _resolve(group, results)


def _resolve(group: Sequence[Item], results: Sequence[bool]) -> None:
    i = 0
    for item in group:
        _resolve_outcomes(item, list(results[i : i + len(item[0])]))
        i += len(item[0])


def _resolve_outcomes(item: Item, outcomes: list[Outcome]) -> None:
    if not item[2].done():
        item[2].set_result(outcomes)


def _fail(group: Sequence[Item], exc: BaseException) -> None:
    for _, _, fut in group:
        if not fut.done():
            fut.set_exception(exc)
