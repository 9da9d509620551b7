"""Bearer-token auth with two scopes: `ingest` (POST batches) and `read` (query API).

Without any configured token, auth is off and the settings only allow loopback binds (or dev
mode). Tokens are compared in constant time. Must not log tokens.
"""

from __future__ import annotations

import enum
import hmac
from collections.abc import Callable

from fastapi import HTTPException, Request, status

from vigil.collector.settings import CollectorSettings


class Scope(enum.StrEnum):
    INGEST = "ingest"
    READ = "read"


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _matches(token: str, allowed: frozenset[str]) -> bool:
    # Compare against every token so timing does not reveal which one (or how many) exist.
    found = False
    for candidate in allowed:
        found |= hmac.compare_digest(token.encode(), candidate.encode())
    return found


def require(scope: Scope, settings: CollectorSettings) -> Callable[[Request], None]:
    """A FastAPI dependency that admits requests carrying a token with `scope`."""
    allowed = settings.tokens_for(scope)
    every = settings.tokens_for(Scope.INGEST) | settings.tokens_for(Scope.READ)

    def check(request: Request) -> None:
        if not settings.auth_enabled:
            return
        token = _bearer(request)
        if token is None or not _matches(token, every):
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED,
                detail="missing or unknown bearer token (Authorization: Bearer <token>)",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if not _matches(token, allowed):
            raise HTTPException(
                status.HTTP_403_FORBIDDEN, detail=f"this token lacks the {scope} scope"
            )

    return check
