"""Benchmarks with baselines measured in the same run (``make bench``): each public module
has ``run()`` + ``report()`` or a ``main()``; ``python -m benchmarks`` runs them all."""
