"""The profiler window: a few steps under ``torch.profiler`` every N steps, and what is
read out of their trace (DESIGN §3, the time breakdown).

Public modules are those other code imports (the ``stepwatch trace`` command, the
collector, users who analyse their own traces); the private ones are driven by the
agent alone:

``trace``
    Kineto Chrome trace -> the intervals and collectives of a window (pure, no torch).
``breakdown``
    Interval math: a step's parts from its activity intervals (pure).
``lineup``
    Collectives lined up across ranks into wait and transfer (pure; the collector runs
    it when every rank of a window has reported, ``stepwatch trace`` on trace files).
``_window``
    Schedule, cost and budget of the windows; drives ``torch.profiler`` from the hot path.
``_entry``
    One finished window -> the ``profiles`` entry of a payload.

Shared with other measurements, and so kept outside: ``stepwatch.sketch`` (quantile
sketch, also read by the collector), ``stepwatch._clock_sync`` (offset to rank 0's clock,
which any cross-rank arrival time needs) and ``stepwatch._nvml`` (device telemetry).
"""
