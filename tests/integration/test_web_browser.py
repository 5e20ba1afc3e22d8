"""The run page as headless Chromium renders it, at a narrow window: what a new user sees
for a short run without a target or a peak, with one or two windows and one rank."""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from stepwatch_server.storage import migrate

from ..browser import browser  # noqa: F401  (a fixture)
from ..live import serve_in_thread
from ..payloads import CONVENTION, payload, profile_entry

NO_PEAK = {**CONVENTION, "peak_flops": None, "id": "explicit/bf16/unknown"}
MEAN_RGB = (0x7A, 0x4F, 0xC9)  # the mean-over-ranks line on the step-time chart


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """SQLite only: the page reads through the same queries on both backends (test_web)."""
    url = f"sqlite:///{tmp_path / 'page.db'}"
    migrate.upgrade(url)
    return url


def _feed(client: httpx.Client, run: str, steps: int, convention: dict[str, Any] | None = CONVENTION) -> None:
    """One rank, 0.5 s steps (20 per stored window at the default 10 s); the profiler
    captured steps 25-26 when the run is long enough."""
    for first in range(1, steps + 1, 20):
        n = min(20, steps - first + 1)
        profiles = None
        if first <= 25 < first + n:
            profiles = [profile_entry(first_step=25, enter=[0.1, 0.6], end=[0.2, 0.7], ranks=(0,))]
        body = payload(run=run, first=first, times=[0.5] * n, convention=convention, profiles=profiles)
        client.post("/api/v1/ingest", json=body).raise_for_status()


def _load(driver: Any, url: str) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(url + "?static")
    WebDriverWait(driver, 30).until(lambda d: d.execute_script("return document.body.dataset.charts"))
    assert driver.execute_script("return document.body.dataset.errors || ''") == ""


def _color_pixels(driver: Any, chart_id: str, rgb: tuple[int, int, int]) -> int:
    return int(
        driver.execute_script(
            "const c = document.querySelector('#' + arguments[0] + ' canvas');"
            "const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
            "const [r, g, b] = arguments[1]; let n = 0;"
            "for (let i = 0; i < d.length; i += 4)"
            "  if (d[i + 3] > 200 && Math.abs(d[i] - r) < 24 && Math.abs(d[i + 1] - g) < 24"
            "      && Math.abs(d[i + 2] - b) < 24) n++;"
            "return n;",
            chart_id,
            list(rgb),
        )
    )


@pytest.mark.parametrize("steps", [16, 40])  # one stored window (16 steps), two or three
def test_a_short_run_reads_well_at_950_px(sqlite_url: str, browser: Any, steps: int) -> None:  # noqa: F811
    from selenium.webdriver.common.by import By

    browser.set_window_size(950, 1100)
    with serve_in_thread(sqlite_url) as url, httpx.Client(base_url=url, timeout=20) as c:
        _feed(c, "short", steps)
        _load(browser, f"{url}/runs/short")

        line = browser.find_element(By.ID, "progress-line").text
        assert "no token target (pass target_tokens=)" in line.lower()
        assert "ETA –" not in line and "of – tokens" not in line

        # The heatmap stays inside its column, and its step labels do not overlap.
        inside = browser.execute_script(
            "const s = document.querySelector('#heatmap svg').getBoundingClientRect();"
            "const box = document.getElementById('heatmap').getBoundingClientRect();"
            "return [s.right <= box.right + 0.5, document.documentElement.scrollWidth"
            " <= document.documentElement.clientWidth];"
        )
        assert inside == [True, True]
        boxes = browser.execute_script(
            "return [...document.querySelectorAll('#heatmap svg text.axis')].map(t => {"
            "  const b = t.getBoundingClientRect(); return [b.left, b.right]; });"
        )
        assert boxes, "the heatmap names its steps"
        for (l1, r1), (l2, r2) in itertools.pairwise(boxes):
            assert r1 <= l2 or r2 <= l1, f"step labels overlap: {boxes}"
        labels = " ".join(t.text for t in browser.find_elements(By.CSS_SELECTOR, "#heatmap svg text.axis"))
        assert re.fullmatch(r"steps \d+–\d+|step \d+ step \d+", labels), labels

        # The MFU axis has more than one tick; the mean line is not hidden under the
        # slowest rank's (with one rank they are the same line).
        assert int(browser.find_element(By.ID, "chart-mfu").get_attribute("data-yticks")) > 1
        assert _color_pixels(browser, "chart-step", MEAN_RGB) > 50

        if steps >= 26:
            assert "profiled steps 25–26" in browser.find_element(By.ID, "profiled").text


def test_a_finished_run_without_a_profiler_window_says_how_to_get_one(
    sqlite_url: str,
    browser: Any,  # noqa: F811
) -> None:
    """A 16-step trial ended before the default profile_every=2000: "no profiler data yet"
    on a finished run waits for nothing; the page says what to set instead."""
    from selenium.webdriver.common.by import By

    with serve_in_thread(sqlite_url) as url, httpx.Client(base_url=url, timeout=20) as c:
        body = payload(run="trial", first=1, times=[0.5] * 16, convention=CONVENTION, final=True)
        c.post("/api/v1/ingest", json=body).raise_for_status()
        _load(browser, f"{url}/runs/trial")
        assert browser.find_element(By.ID, "run-status").text == "finished"
        text = browser.find_element(By.ID, "breakdown").text
        assert "ended before the first one" in text and "profile_every=20" in text, text
        assert "stepwatch capture RUN --all" in text, text
        assert "yet" not in text, text


def test_without_a_peak_the_page_says_how_to_get_mfu(sqlite_url: str, browser: Any) -> None:  # noqa: F811
    from selenium.webdriver.common.by import By

    hint = "MFU needs a peak FLOP/s: pass peak_flops= (see README: finding a peak)"
    with serve_in_thread(sqlite_url) as url, httpx.Client(base_url=url, timeout=20) as c:
        _feed(c, "nopeak", 20, convention=NO_PEAK)
        _load(browser, f"{url}/runs/nopeak")
        assert browser.find_element(By.ID, "mfu-latest").text == hint
        assert browser.find_element(By.ID, "chart-mfu").text == hint
        assert "no data yet" not in browser.find_element(By.ID, "cards").text
        assert browser.find_element(By.ID, "run-status").text == "live"
