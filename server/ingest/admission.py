"""Who may write into a run, and how many runs a write token may create.

The quota is decided by the database, not by a check before the write: a new run takes
one from its token's counter row (``token_quotas``) with a conditional increment, in the
same transaction that inserts the run. The increment takes the row's lock, so
concurrent first batches of new runs queue on it and exactly ``limit`` of them find room;
a run whose insert loses a race for its name rolls its increment back. The check reads
one row, whatever the number of runs.

A run belongs to the token that created it: other write tokens may not post into it
unless they are configured as shared (``STEPWATCH_SHARED_WRITE_TOKENS``). With writes
open (no tokens configured) there is nobody to tell apart and everyone may write.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection, select, update

from ..storage.models import TokenQuota

#: The quota row of writes without a token (writes open).
ANONYMOUS = ""


class QuotaExceededError(Exception):
    """The token has created ``used`` runs, its whole quota."""

    def __init__(self, used: int) -> None:
        super().__init__(f"{used} runs created")
        self.used = used


def take_run(conn: Connection, insert: Callable[[Any], Any], owner: str | None, limit: int) -> None:
    """Count one new run against ``owner``'s quota inside the caller's transaction; raise
    :class:`QuotaExceededError` if none is left. ``insert`` is the dialect's insert (for
    its ``ON CONFLICT``)."""
    t = TokenQuota.__table__
    token = owner or ANONYMOUS
    conn.execute(
        insert(t).values(token=token, runs_created=0).on_conflict_do_nothing(index_elements=["token"])
    )
    taken = conn.execute(
        update(TokenQuota)
        .where(t.c.token == token, t.c.runs_created < limit)
        .values(runs_created=t.c.runs_created + 1)
        .returning(t.c.runs_created)
    ).first()
    if taken is None:
        used = conn.execute(select(t.c.runs_created).where(t.c.token == token)).scalar_one()
        raise QuotaExceededError(int(used))


def may_write(run_owner: str | None, writer: str | None, shared: frozenset[str]) -> bool:
    """True if token ``writer`` may post into a run created by ``run_owner``."""
    if writer is None or run_owner is None:  # writes open now, or when the run was created
        return True
    return writer == run_owner or writer in shared
