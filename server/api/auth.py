"""Bearer tokens for writing (agents), reading (dashboards, people) and steering (admins).

Configured from the environment, each a comma-separated list of entries:

    STEPWATCH_WRITE_TOKENS="team-a=s3cret,team-b=sha256:9f86d08...
    STEPWATCH_READ_TOKENS="grafana=sha256:..."
    STEPWATCH_ADMIN_TOKENS="oncall=..."

An entry is ``[name=]secret`` or ``[name=]sha256:<hex of the secret's SHA-256>`` (so the
secret itself need not sit in the environment). A list left empty leaves that side open
(the development default). Admin tokens ask for captures and change the agents' live
settings (``api/steering.py``), and may read; steering is open only while no token of any
kind is configured: a collector with write or read tokens and no admin token refuses it.
Every presented token is compared with every configured one
with ``hmac.compare_digest`` over SHA-256 digests: constant time, whatever the lengths,
and no early exit that would tell which entry was close.

Answers: no or unknown token -> 401 with ``WWW-Authenticate: Bearer``; a known token
without the needed right (a read token posting, a write token reading) -> 403.
``/healthz`` and ``/readyz`` are always open (probes); ``/metrics`` is open unless
``STEPWATCH_METRICS_REQUIRE_TOKEN`` is set; the OpenAPI document is open.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from ..errors import ForbiddenError, UnauthorizedError

Scope = Literal["read", "write", "admin"]
bearer = HTTPBearer(auto_error=False, description="A write token for POST /ingest, a read token for GET")


@dataclass(frozen=True)
class Token:
    name: str
    digest: bytes
    scope: Scope


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


#: The environment variable each scope's list is read from, named in every complaint.
SETTING: dict[Scope, str] = {
    "write": "STEPWATCH_WRITE_TOKENS",
    "read": "STEPWATCH_READ_TOKENS",
    "admin": "STEPWATCH_ADMIN_TOKENS",
}
MIN_SECRET_CHARS = 16


def parse_tokens(spec: str, scope: Scope) -> list[Token]:
    """Parse ``[name=]secret`` / ``[name=]sha256:<hex>`` entries; ValueError names a bad one."""
    tokens = []
    for raw in spec.split(","):
        entry = raw.strip()
        if not entry:
            continue
        name, sep, secret = entry.partition("=")
        if not sep:
            name, secret = "", entry
        if secret.startswith("sha256:"):
            hexdigest = secret[len("sha256:") :]
            try:
                digest = bytes.fromhex(hexdigest)
            except ValueError:
                digest = b""
            if len(digest) != 32:
                raise ValueError(f"{SETTING[scope]}: token {name or '?'}: sha256: needs 64 hex digits")
        else:
            if len(secret) < MIN_SECRET_CHARS:
                raise ValueError(
                    f"{SETTING[scope]}: token {name or '?'} is {len(secret)} characters; a secret needs "
                    f"at least {MIN_SECRET_CHARS} characters (or give sha256:<64 hex digits>)"
                )
            digest = _digest(secret)
        tokens.append(Token(name=name or digest.hex()[:12], digest=digest, scope=scope))
    return tokens


class Authenticator:
    """Decides who a request is; owned by the app (built from its settings)."""

    def __init__(self, write: list[Token], read: list[Token], admin: list[Token] | None = None) -> None:
        admin = admin or []
        self.write_open = not write
        self.read_open = not read
        self.admin_open = not (write or read or admin)
        self._tokens = [*write, *read, *admin]

    @classmethod
    def from_specs(cls, write: str, read: str, admin: str = "") -> Authenticator:
        return cls(parse_tokens(write, "write"), parse_tokens(read, "read"), parse_tokens(admin, "admin"))

    def _open(self, scope: Scope) -> bool:
        return {"write": self.write_open, "read": self.read_open, "admin": self.admin_open}[scope]

    def identify(self, presented: str) -> Token | None:
        digest = _digest(presented)
        found = None
        for token in self._tokens:  # no early exit: every comparison is made
            if hmac.compare_digest(digest, token.digest) and found is None:
                found = token
        return found

    def check(self, credentials: HTTPAuthorizationCredentials | None, scope: Scope) -> str | None:
        """The name of the token allowed to do ``scope``; None on an open side (where a
        token is not needed, and one that is not for this side is ignored)."""
        token = self.identify(credentials.credentials) if credentials is not None else None
        if self._open(scope):
            return token.name if token is not None and token.scope == scope else None
        if credentials is None:
            raise UnauthorizedError(
                f"this collector requires a bearer token to {scope} (Authorization: Bearer ...)",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if token is None:
            raise UnauthorizedError(
                "unknown bearer token", headers={"WWW-Authenticate": 'Bearer error="invalid_token"'}
            )
        if token.scope != scope and not (token.scope == "admin" and scope == "read"):
            verb = "steer" if scope == "admin" else scope
            raise ForbiddenError(
                f"token {token.name!r} may {token.scope} but not {verb}"
                + (" (steering needs a token of STEPWATCH_ADMIN_TOKENS)" if scope == "admin" else "")
            )
        return token.name


def authenticator(request: Request) -> Authenticator:
    auth: Authenticator = request.app.state.auth
    return auth


Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]


async def require_write(request: Request, credentials: Credentials) -> str | None:
    """Dependency of the ingest route: the writing token's name (None when writes are open)."""
    return authenticator(request).check(credentials, "write")


async def require_admin(request: Request, credentials: Credentials) -> str | None:
    """Dependency of the steering routes: an admin token (open only with no token configured)."""
    return authenticator(request).check(credentials, "admin")


async def require_read(request: Request, credentials: Credentials) -> str | None:
    """Dependency of the read routes (and of /metrics when it requires a token)."""
    return authenticator(request).check(credentials, "read")
