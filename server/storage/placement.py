"""Rows stored before a run's window size was known, moved to their windows once it is.

While a run's window size is provisional (``store.pace_is_known``), the rank windows of
the steps it stores (each rank's start-up step, alone in its batch) cannot be placed:
step 5001 of a job resumed from a checkpoint lies in window 5000 of 1-step windows and
in window 312 of 16-step ones. They are stored in *unplaced* windows, ``-step``
(``columns.placed_window``), and moved here: by the writer that settles the size, in the
same transaction, and by every analysis pass before it reads a settled run (a writer
that read the run as provisional just before another settled it stores its row
unplaced after the move).

The move is exactly once whoever runs it: the rows are taken by ``DELETE ... RETURNING``
(a concurrent mover waits for the row locks, then finds them gone), and written back
through the storage's upsert, so each merges by the column rules (``columns.py``) into
whatever its window already holds, as a late batch would.
"""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy import Connection, Table, delete

from . import columns
from .backend import Storage
from .columns import Columns, Rows
from .models import RankWindow

RW = cast(Table, RankWindow.__table__)


def place_unplaced(conn: Connection, storage: Storage, run_id: int, window_steps: int) -> int:
    """Move the run's unplaced rank windows to their windows of ``window_steps``; returns
    how many rows moved."""
    names = [c.name for c in RW.columns]
    taken = conn.execute(
        delete(RW).where(RW.c.run_id == run_id, RW.c.window < 0).returning(*RW.columns)
    ).all()
    if not taken:
        return 0
    rows = [dict(zip(names, r, strict=True)) for r in taken]
    for r in rows:
        r["window"] = columns.window_of(int(r["first_step"]), window_steps)
    rows.sort(key=lambda r: (r["rank"], r["window"], r["first_step"]))
    # One statement merges each key once: rows of the same key (a rank's steps that
    # arrived as separate start-up batches) go in successive statements.
    rounds: list[list[dict[str, Any]]] = []
    seen: dict[tuple[int, int], int] = {}
    for r in rows:
        k = (r["rank"], r["window"])
        i = seen[k] = seen.get(k, -1) + 1
        if i == len(rounds):
            rounds.append([])
        rounds[i].append(r)
    for batch in rounds:
        cols: Columns = {n: [r[n] for r in batch] for n in names}
        storage.write(conn, Rows(ranks={}, windows=cols, job_steps={}))
    return len(rows)
