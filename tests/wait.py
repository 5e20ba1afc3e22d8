"""The suite's one way to wait: poll a condition until it holds or a deadline passes.

Never a sleep as synchronisation: ``check`` is called until it returns something truthy,
which is returned; past ``timeout_s`` the test fails naming ``what`` it waited for. The
poll interval only spaces the checks (a loaded machine makes the wait longer, never the
result different).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(check: Callable[[], T], what: str, *, timeout_s: float = 15.0, every_s: float = 0.02) -> T:
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(every_s)
