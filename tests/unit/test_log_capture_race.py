"""pytest's log capture beside a thread that creates loggers (the shim in ``tests/conftest.py``).

Without the shim, entering ``catching_logs`` while another thread creates loggers raised
"dictionary changed size during iteration" (512 times in 22,188 entries here, 3 s), as it
did at the setup of an unrelated test in two fresh CI runs."""

from __future__ import annotations

import logging
import sys
import threading
import time

from _pytest.logging import LogCaptureHandler, catching_logs

PREFIX = "stepwatch-test-race."


def test_entering_log_capture_while_a_thread_creates_loggers_never_fails() -> None:
    made: list[str] = []

    def create() -> None:
        for i in range(20_000):
            made.append(f"{PREFIX}{i}")
            logging.getLogger(made[-1])
            if i % 50 == 0:
                time.sleep(0)  # let the main thread in, mid-way

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads switch often: the race shows within the loop
    thread = threading.Thread(target=create, daemon=True)
    errors, entered = [], 0
    try:
        thread.start()
        while thread.is_alive():  # as long as loggers are being created
            entered += 1
            try:
                with catching_logs(LogCaptureHandler()):
                    pass
            except RuntimeError as exc:
                errors.append(str(exc))
    finally:
        thread.join()
        sys.setswitchinterval(interval)
        with logging._lock:  # type: ignore[attr-defined]  # the test's loggers, gone again
            for name in made:
                logging.Logger.manager.loggerDict.pop(name, None)
    assert entered > 0 and errors == []
