"""Ingest: group commit, the fold of a group into rows, profiler windows and the wait/transfer split."""
