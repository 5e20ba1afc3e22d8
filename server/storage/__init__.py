"""Storage: SQLAlchemy models, engine construction, backend statements, retention and migrations glue."""
