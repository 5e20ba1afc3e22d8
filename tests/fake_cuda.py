"""A stand-in for ``torch.cuda.Event``: there is no GPU on the machines this suite runs on.

It keeps what the agent's device clocks use of an event (``record``, ``query``,
``elapsed_time``) with a device timestamp the test advances (a shared list, in ms) and a
completion flag the test controls, counts its records, and fails the test if anything
calls ``synchronize()``: nothing in the agent may wait for the device. What real events
do on a GPU is checked by ``make gpu-check``.
"""

from __future__ import annotations


class FakeEvent:
    def __init__(self, device: list[float], *, done: bool = True) -> None:
        self._device = device  # the shared "device clock" in ms, advanced by the test
        self.t: float | None = None
        self.done = done
        self.records = 0

    def record(self) -> None:
        self.t = self._device[0]
        self.records += 1

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end_event: FakeEvent) -> float:
        assert self.done and end_event.done, "elapsed_time on an incomplete event would block"
        if self.t is None or end_event.t is None:
            raise RuntimeError("event not recorded")  # what torch raises for an unrecorded event
        return end_event.t - self.t

    def synchronize(self) -> None:
        raise AssertionError("the agent must never synchronise the device")
