"""A real PostgreSQL server for the tests, and a fresh database per test session.

Order of preference:
1. ``STEPWATCH_TEST_PG_URL`` (an admin URL, e.g. postgresql://postgres@127.0.0.1:5432/postgres);
2. the server that answers on 127.0.0.1:5432 (there is one on development and CI machines);
3. a throwaway cluster started here with ``initdb`` and ``pg_ctl`` (as pytest-postgresql does).
If none of these works the tests fail with a message saying how to install PostgreSQL:
they never skip silently.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
from psycopg import sql

DEFAULT_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
INSTALL_HINT = (
    "PostgreSQL is needed for the integration tests. Either set STEPWATCH_TEST_PG_URL to an admin URL, "
    "run a server on 127.0.0.1:5432 with trust auth, or install the server binaries "
    "(Debian: apt-get install -y postgresql) so that the tests can start a throwaway cluster."
)


def _answers(url: str) -> bool:
    try:
        with psycopg.connect(url, connect_timeout=3):
            return True
    except psycopg.Error:
        return False


def _pg_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for base in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (base / name).exists():
            return str(base / name)
    return None


class Cluster:
    """A private PostgreSQL cluster that a test can stop and start (a database restart)."""

    def __init__(self, port: int) -> None:
        initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
        if not initdb or not pg_ctl:
            raise RuntimeError(INSTALL_HINT)
        self.port, self._pg_ctl = port, pg_ctl
        self.root = tempfile.mkdtemp(prefix="stepwatch-pg-")
        self.data, sock = os.path.join(self.root, "data"), os.path.join(self.root, "sock")
        os.makedirs(sock)
        self._run_as: list[str] = []
        if os.geteuid() == 0:  # initdb refuses to run as root
            user = pwd.getpwnam("postgres")
            for path in (self.root, sock):
                os.chown(path, user.pw_uid, user.pw_gid)
            self._run_as = ["runuser", "-u", "postgres", "--"]
        subprocess.run(
            [*self._run_as, initdb, "-D", self.data, "-A", "trust", "-U", "postgres"],
            check=True,
            capture_output=True,
        )
        self._opts = f"-p {port} -k {sock} -c listen_addresses=127.0.0.1 -c fsync=on"
        self.url = f"postgresql://postgres@127.0.0.1:{port}/postgres"

    def start(self) -> None:
        subprocess.run(
            [
                *self._run_as,
                self._pg_ctl,
                "-D",
                self.data,
                "-o",
                self._opts,
                "-w",
                "-l",
                os.path.join(self.root, "log"),
                "start",
            ],
            check=True,
            capture_output=True,
        )

    def stop(self, mode: str = "fast") -> None:
        """``immediate`` is a crash: no checkpoint, recovery from the WAL at the next start."""
        subprocess.run(
            [*self._run_as, self._pg_ctl, "-D", self.data, "-m", mode, "-w", "stop"], capture_output=True
        )

    def remove(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


@contextmanager
def cluster(port: int) -> Iterator[Cluster]:
    """A started private cluster on ``port``, removed afterwards."""
    c = Cluster(port)
    try:
        c.start()
        yield c
    finally:
        c.remove()


@contextmanager
def throwaway_cluster(port: int) -> Iterator[str]:
    """Start a private cluster on ``port``; stop it (by its own pg_ctl) afterwards."""
    with cluster(port) as c:
        yield c.url


@contextmanager
def admin_url() -> Iterator[str]:
    url = os.environ.get("STEPWATCH_TEST_PG_URL")
    if url:
        if not _answers(url):
            raise RuntimeError(f"STEPWATCH_TEST_PG_URL={url} does not answer. {INSTALL_HINT}")
        yield url
        return
    if _answers(DEFAULT_ADMIN):
        yield DEFAULT_ADMIN
        return
    from stepwatch.demo.launch import free_port

    with throwaway_cluster(free_port()) as url:
        yield url


@contextmanager
def fresh_database(admin: str, prefix: str = "stepwatch_test", template: str | None = None) -> Iterator[str]:
    """Create a uniquely named database (a copy of ``template`` if given); drop it
    afterwards. Yields its SQLAlchemy URL."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    create = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
    if template is not None:
        create = sql.SQL("{} TEMPLATE {}").format(create, sql.Identifier(template))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(create)
    base = admin.rsplit("/", 1)[0]
    try:
        yield f"{base}/{name}".replace("postgresql://", "postgresql+psycopg://", 1)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
