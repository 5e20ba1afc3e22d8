"""When a failed HTTP POST is worth repeating, and how long to wait before it.

One policy for stepwatch's two retrying senders (the agent's batch sender and the
collector's webhook), so that they agree on what a status means. Standard library only:
it is imported inside the training process.

A failed attempt is one of three things:

- the server (or a gateway in front of it) is away or busy: no answer at all, 408, 425,
  429, 502, 503, 504. Nothing is wrong with the request; it is repeated, however long
  that takes, and a sender with a bounded buffer keeps what comes after it;
- the server failed on this request: 500 and any other 5xx. It may succeed on a retry,
  but it may be the request itself the server cannot handle, so it is repeated a bounded
  number of times and then given up (and counted), so that one bad batch never holds up
  the ones behind it;
- the server refused the request for good: any other status (a 4xx other than 408, 425
  and 429, or a 3xx redirect, which is not followed). Repeating it cannot help.

Waits use exponential backoff with full jitter (each wait uniform in ``[0, min(cap,
base * 2**n)]``; AWS Architecture Blog, "Exponential Backoff And Jitter"), which spreads
a fleet's retries best, and never less than the server's ``Retry-After``.
"""

from __future__ import annotations

import enum
import random
import time
from collections.abc import Callable
from email.utils import parsedate_to_datetime

#: Statuses after which the same request may succeed later.
RETRYABLE_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})
#: Those of them that describe the server's or a gateway's state, not the request.
UNAVAILABLE_STATUSES = frozenset({408, 425, 429, 502, 503, 504})


class Verdict(enum.Enum):
    """What to do with a request after one attempt."""

    DONE = "done"  #: 2xx: delivered
    WAIT = "wait"  #: server away or busy: repeat without limit
    RETRY = "retry"  #: server failed on it: repeat a bounded number of times
    REFUSED = "refused"  #: permanent: give up now


def verdict(status: int | None) -> Verdict:
    """Classify one attempt by its HTTP status (``None``: no answer, a connection error)."""
    if status is None or status in UNAVAILABLE_STATUSES:
        return Verdict.WAIT
    if 200 <= status < 300:
        return Verdict.DONE
    if status >= 500:
        return Verdict.RETRY
    return Verdict.REFUSED


def full_jitter(
    failures: int, base_s: float, cap_s: float, rand: Callable[[], float] = random.random
) -> float:
    """Seconds to wait after ``failures`` consecutive failed attempts (1 for the first)."""
    ceiling = min(cap_s, base_s * 2.0 ** min(max(0, failures - 1), 62))
    return ceiling * rand()


def retry_after_s(value: str | None, *, cap_s: float = 60.0, now: float | None = None) -> float | None:
    """A ``Retry-After`` header as seconds from now (RFC 9110 10.2.3: delay-seconds or an
    HTTP-date), within ``[0, cap_s]``; ``None`` when absent or unreadable. The cap keeps a
    server's "come back in an hour" from stalling a sender that has a deadline."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:  # RFC 9110 dates are GMT
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    if seconds != seconds:  # NaN
        return None
    return min(cap_s, max(0.0, seconds))
