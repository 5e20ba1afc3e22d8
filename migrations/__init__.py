"""Alembic migration environment of the collector (packaged as stepwatch_server.migrations)."""
