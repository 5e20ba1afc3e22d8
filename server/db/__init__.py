"""Storage: SQLAlchemy models, engine construction and migrations."""
