"""The web page over real HTTP on both backends: the runs list, a run's page with its
breakdown and a bounded heatmap, a helpful 404, and the vendored static files.

The breakdown columns of ``rank_windows`` are filled by the profiler-window work; here
they are set directly on the stored windows, so the page is tested against the same
columns that work writes.
"""

from __future__ import annotations

import json
import re
from html import unescape

import httpx
from sqlalchemy import update

from stepwatch_server.storage.engine import make_engine
from stepwatch_server.storage.models import RankWindow

from ..events import insert_event
from ..live import serve_in_thread
from ..payloads import payload

RUN, RANKS, SLOW = "web-run", 70, 41


def _feed(client: httpx.Client) -> None:
    for rank in range(RANKS):
        body = payload(run=RUN, rank=rank, world=RANKS, first=1, times=[0.5] * 8)
        client.post("/api/v1/ingest", json=body).raise_for_status()


def _profile(db_url: str) -> None:
    """Rank 41 computes 0.36 s of its 0.5 s step, its peers 0.25 s (a compute straggler)."""
    engine = make_engine(db_url)
    rw = RankWindow.__table__
    with engine.begin() as conn:
        conn.execute(
            update(rw).values(
                profiled_steps=2, compute_s=0.25, comm_overlapped_s=0.05, comm_exposed_s=0.15, idle_s=0.05
            )
        )
        conn.execute(update(rw).where(rw.c.rank == SLOW).values(compute_s=0.36, comm_exposed_s=0.04))
    engine.dispose()


def test_pages_over_http(db_url: str) -> None:
    with serve_in_thread(db_url) as url, httpx.Client(base_url=url, timeout=20) as c:
        empty = c.get("/")
        assert (
            empty.status_code == 200 and "No runs yet" in empty.text and "stepwatch demo --hold" in empty.text
        )
        _feed(c)
        _profile(db_url)
        insert_event(db_url, RUN, first_step=1, last_step=8, ranks=[SLOW], status="open")

        runs = c.get("/")
        assert runs.headers["content-type"].startswith("text/html")
        row = re.search(rf'<a href="[^"]*/runs/{RUN}">{RUN}</a>(.*?)</tr>', runs.text, re.S)
        assert row and f"{RANKS}/{RANKS}" in row[1] and '<span class="badge bad">1</span>' in row[1]

        page = c.get(f"/runs/{RUN}")
        assert page.status_code == 200
        html = page.text
        assert "1 open event" in html and "straggler / compute" in html
        # Breakdown: means over ranks of the latest profiled window, shares of their sum.
        shares = dict(
            re.findall(r"<td><i [^>]*></i>([a-z ]+)</td><td[^>]*>[^<]*</td><td[^>]*>([\d.]+)%</td>", html)
        )
        mean_compute = (0.25 * (RANKS - 1) + 0.36) / RANKS
        mean_exposed = (0.15 * (RANKS - 1) + 0.04) / RANKS
        total = mean_compute + 0.05 + mean_exposed + 0.0 + 0.05
        assert float(shares["compute"]) == round(100 * mean_compute / total, 1)
        assert float(shares["comm exposed"]) == round(100 * mean_exposed / total, 1)
        # Heatmap: compute time by default once profiled; 64 of 70 ranks, the flagged one first in.
        assert "Ranks over time: compute" in html and f"Showing 64 of {RANKS} ranks" in html
        labels = [
            int(x)
            for x in re.findall(
                r'<text x="40" y="[\d.]+" text-anchor="end" class="[a-z]*">(\d+)</text>', html
            )
        ]
        assert len(labels) == 64 and labels == sorted(labels) and SLOW in labels
        assert re.search(rf'class="flagged">{SLOW}</text>', html)
        hot = re.search(rf"rank {SLOW}, steps 1–8: 0.36 s \((\d.\d\d)× median\)", unescape(html))
        assert hot and float(hot[1]) == round(0.36 / 0.25, 2)
        # The charts' data: the run's own series, embedded for the page's script.
        data = json.loads(unescape(re.search(r'id="page-data" hidden data-json="([^"]*)"', html)[1]))
        assert data["charts"]["step_time_s"]["step"] == list(range(1, 9))
        assert data["charts"]["mfu"]["mean"][0] > 0
        assert data["events"] == [{"kind": "straggler", "first_step": 1, "last_step": 8, "status": "open"}]

        other = c.get(f"/runs/{RUN}", params={"heat": "step_time_s"})
        assert "Ranks over time: step time" in other.text

        missing = c.get("/runs/nope")
        assert missing.status_code == 404 and "No run named “nope”" in missing.text and RUN in missing.text

        script = c.get("/static/uPlot.iife.min.js")
        assert script.status_code == 200 and "uPlot" in script.text[:2000]
        assert "MIT License" in c.get("/static/uPlot.LICENSE").text
        assert all(
            not p.startswith(("/runs", "/static")) or p.startswith("/api")
            for p in c.get("/openapi.json").json()["paths"]
        )
