"""API-key authentication: the ``X-API-Key`` header, compared in constant time.

The key comes from ``HANGAR_API_KEY`` or the 0600 file ``<data>/api-key``,
generated on first start. It is never logged and never accepted in a URL.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

from fastapi import HTTPException, Request, Security
from fastapi.security import APIKeyHeader

HEADER = APIKeyHeader(name="X-API-Key", auto_error=False,
                      description="The server's API key (see <data>/api-key).")


def load_or_create_key(path: Path) -> str:
    """Read the key file, creating it (0600, 32 random bytes, urlsafe) if absent."""
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    key = "hk_" + secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key


def require_key(request: Request, given: str | None = Security(HEADER)) -> None:
    """FastAPI dependency: 401 unless the request carries the server's key."""
    expected: str = request.app.state.api_key
    if not hmac.compare_digest((given or "").encode(), expected.encode()):
        raise HTTPException(401, "missing or wrong X-API-Key header")
