"""``stepwatch evaluate``: score the detectors on simulated faults and clean runs.

- :mod:`.scenarios`: the fault and clean scenarios and what each must raise.
- :mod:`.paths`: run a scenario through a real collector process, or straight into the
  detectors.
- :mod:`.score`: flagged, right cause and rank, windows to flag, false flags.
- :mod:`.cli`: the command and its table.
"""
