"""Grafana dashboards and Prometheus rules for stepwatch, as code.

One configuration (``config.py``) feeds the recording and alert rules (``rules.py``) and
the dashboards (``grafana.py``); ``python -m dashboards.generate`` writes the files that
docker-compose mounts, and the tests fail when the committed files drift from it.
"""
