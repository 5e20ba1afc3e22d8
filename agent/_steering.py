"""Directives from the collector: received on the sender thread, applied on the training thread.

The collector steers its agents through the answers to their own POSTs (``wire``'s
steering contract): a capture (profile steps ``S .. S+K-1`` on several ranks at once) or a
new value of a live setting (send interval, profiler period and length). The sender thread
parses the answer and queues what is new; the training thread applies the queue when it
closes a window (its rare path, once per send interval), so the hot path never looks at it
and nothing is shared but two deques (``append``/``popleft`` are atomic under the GIL: no
lock). Each directive is applied at most once per process (by ``id``); one that cannot be
applied is acknowledged with the reason, never raised into the training loop.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict, deque
from collections.abc import Mapping
from typing import Any

from . import wire

_ID = re.compile(wire.DIRECTIVE_ID_PATTERN)
#: Directive ids remembered (to apply each once, and to acknowledge a repeat again).
SEEN = 256


class Steering:
    """The inbox of directives and the outbox of acknowledgements of one agent."""

    def __init__(self) -> None:
        #: New directives, oldest first (sender thread appends, training thread pops).
        self.inbox: deque[dict[str, Any]] = deque(maxlen=4 * wire.MAX_DIRECTIVES)
        #: Acks to send (training and profiler threads append, the sender thread pops).
        self._acks: deque[dict[str, Any]] = deque(maxlen=4 * wire.MAX_ACKS)
        #: id -> its last ack (sender thread only; the training thread records through
        #: ``ack``, whose dict the sender thread files here when it takes it).
        self._seen: OrderedDict[str, dict[str, Any] | None] = OrderedDict()
        self.received = 0
        self.ignored = 0
        #: Config directives this process applied or refused, newest last (the agent
        #: section's ``configs``): replaced whole, so the sender thread reads it without
        #: a lock while the training thread acknowledges the next one.
        self.configs: tuple[str, ...] = ()

    # -- sender thread ---------------------------------------------------------------
    def receive(self, body: bytes) -> bool:
        """Queue the new directives of an ingest answer; a repeat is acknowledged again
        (its ack was lost with a dropped batch) and a malformed one is ignored. Returns
        whether a new capture was queued (the caller then readies the profiler, here on
        the sender thread, rather than at the capture's start on the training thread)."""
        capture = False
        if b'"directives"' not in body:  # the common answer: no parse at all
            return False
        try:
            answer = json.loads(body)
        except ValueError:
            return False
        directives = answer.get("directives") if isinstance(answer, dict) else None
        if not isinstance(directives, list):
            return False
        for d in directives[: wire.MAX_DIRECTIVES]:
            ident = d.get("id") if isinstance(d, dict) else None
            if (
                not isinstance(ident, str)
                or not _ID.match(ident)
                or d.get("kind") not in wire.DIRECTIVE_KINDS
            ):
                self.ignored += 1
                continue
            if ident in self._seen:
                last = self._seen[ident]
                if last is not None:
                    self._acks.append(last)
                continue
            self._seen[ident] = None
            while len(self._seen) > SEEN:
                self._seen.popitem(last=False)
            self.received += 1
            v = d.get("v", 1)
            if not isinstance(v, int) or v > wire.DIRECTIVES_VERSION:
                state: wire.AckState = "missed" if d["kind"] == "capture" else "refused"
                self.ack(
                    ident,
                    state,
                    f"directive version {v!r} is newer than this agent's ({wire.DIRECTIVES_VERSION})",
                )
                continue
            capture = capture or d["kind"] == "capture"
            self.inbox.append(d)
        return capture

    def take_acks(self) -> list[dict[str, Any]]:
        """The acks to send with the next payload (at most ``wire.MAX_ACKS``)."""
        out: list[dict[str, Any]] = []
        while len(out) < wire.MAX_ACKS:
            try:
                a = self._acks.popleft()
            except IndexError:
                break
            out.append(a)
            if a["id"] in self._seen:
                self._seen[a["id"]] = a
        return out

    # -- training (and profiler) thread ------------------------------------------------
    def ack(
        self,
        ident: str,
        state: wire.AckState,
        reason: str | None = None,
        settings: Mapping[str, float] | None = None,
    ) -> None:
        a: dict[str, Any] = {"id": ident, "state": state}
        if reason:
            a["reason"] = reason[:200]
        if settings:
            a["settings"] = dict(settings)
        if state in ("applied", "refused"):
            self.configs = (*self.configs, ident)[-wire.MAX_CONFIGS_REPORTED :]
        self._acks.append(a)  # no logging here: its handlers' locks are the sender's too
