"""Reads: runs, overview, series, ranks and profiler views, derived from the stored rows."""
