"""The demo: a tiny GPT-like model trained by real gloo processes, timed always-on.

Used by ``stepwatch demo`` and by the end-to-end tests, so the tests exercise exactly
what a new user runs.
"""
