"""Server side of the ``stepwatch`` command (imported lazily by ``stepwatch.cli``)."""

from __future__ import annotations

import logging

from .db import migrate
from .settings import Settings


def _settings(**overrides: object) -> Settings:
    values = {k: v for k, v in overrides.items() if v is not None}
    return Settings(**values)  # type: ignore[arg-type]


def db_upgrade(*, database_url: str | None, revision: str = "head") -> int:
    settings = _settings(database_url=database_url)
    migrate.upgrade(settings.database_url, revision)
    print(f"database at {migrate.current_revision_for_url(settings.database_url)}")
    return 0


def serve(*, host: str | None, port: int | None, database_url: str | None, log_level: str = "info") -> int:
    import uvicorn

    from .app import create_app

    settings = _settings(host=host, port=port, database_url=database_url)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.migrate_on_start:
        migrate.upgrade(settings.database_url)
    app = create_app(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=log_level, access_log=False)
    return 0
