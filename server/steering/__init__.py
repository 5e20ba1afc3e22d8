"""Steering: the collector's directives to its agents (captures, live settings).

``directives.py`` chooses and writes them, ``delivery.py`` hands each rank its own in the
answers to its batches; the agent's acks are stored at ingest (``ingest/acks.py``) and a
capture's explanation is built by the analysis worker (``worker/captures.py``).
"""
