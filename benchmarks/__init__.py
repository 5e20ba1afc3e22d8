"""Benchmarks: each module with a ``main()`` prints its figures as ratios against a
baseline measured in the same run. ``python -m benchmarks`` runs them all."""
