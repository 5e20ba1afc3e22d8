"""Headless Chromium through Debian's chromedriver (selenium), for the page tests."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest


def _driver(user_dir: str) -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = "/usr/bin/chromium"
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--no-first-run",
        "--hide-scrollbars",
        "--force-device-scale-factor=1",
        f"--user-data-dir={user_dir}",
    ):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)


@pytest.fixture
def browser(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    # Debian's chromedriver; never download one. For this test only: a variable left set
    # would make every later rank differ from the forkserver's (``launch.forked``).
    monkeypatch.setenv("SE_OFFLINE", os.environ.get("SE_OFFLINE", "true"))
    with tempfile.TemporaryDirectory() as user_dir:
        driver = _driver(user_dir)
        try:
            driver.set_window_size(1360, 1150)
            yield driver
        finally:
            driver.quit()
