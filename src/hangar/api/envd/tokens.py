"""Who may use a sandbox's envd: its access token, a Hangar key, or a signed file URL.

Every sandbox has an envd access token (``hangar.core.e2b.access_token``:
derived from the server's port key and the sandbox id, never stored). E2B's
control plane (``hangar.api.e2b``) hands it out as ``envdAccessToken``; the
SDK sends it back in ``X-Access-Token``. Its ``trafficAccessToken`` is another
value (``hangar.core.e2b.traffic_token``), taken in ``E2B-Traffic-Access-Token``
for user ports only (``hangar.core.e2b.traffic_admits``). A request is
admitted when it carries the access token, or a valid Hangar API key
in ``X-API-Key`` (sandboxes made through Hangar's own API), or, for
``/files``, the SDK's signature of the path, operation, user and expiry:
``v1_`` + unpadded base64 of SHA-256 over ``path:op:user:token[:expiry]``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time

from hangar.core.service import SandboxManager, e2b

__all__ = ["access_token", "signature", "signature_ok", "signer", "token_ok"]

access_token = e2b.access_token
"""A sandbox's envd access token (``hangar.core.e2b.access_token``)."""


def token_ok(manager: SandboxManager, sandbox_id: str, given: str | None) -> bool:
    """Whether ``given`` is ``sandbox_id``'s access token (constant time)."""
    return e2b.check_access_token(manager, sandbox_id, given)


def signature(token: str, path: str, operation: str, user: str,
              expiration: int | None) -> str:
    """The SDK's signature of a file URL (``operation``: ``read`` or ``write``)."""
    raw = f"{path}:{operation}:{user}:{token}"
    if expiration is not None:
        raw += f":{expiration}"
    digest = hashlib.sha256(raw.encode()).digest()
    return "v1_" + base64.b64encode(digest).rstrip(b"=").decode()


EXPIRED = "signature is already expired"
"""E2B's envd's message for a file URL past its ``signature_expiration`` (a 401)."""


def signature_ok(manager: SandboxManager, sandbox_id: str, given: str, path: str,
                 operation: str, user: str, expiration: str | None) -> str | None:
    """None when ``given`` signs this file operation and has not expired, else why not."""
    exp: int | None = None
    if expiration:
        if not (expiration.isascii() and expiration.isdigit()) or len(expiration) > 12:
            return "signature_expiration is not a Unix time"
        exp = int(expiration)
        if exp < time.time():
            return EXPIRED
    want = signature(access_token(manager, sandbox_id), path, operation, user, exp)
    if not hmac.compare_digest(given.encode(), want.encode()):
        return "the signature does not match this path, operation and user"
    return None


def signer(manager: SandboxManager, sandbox_ids: list[str], given: str, path: str,
           operation: str, user: str, expiration: int | None) -> str | None:
    """The one of ``sandbox_ids`` whose token made signature ``given`` of this file
    operation, or None. The client's part (``path``, ``user``) is hashed once, then each
    sandbox's token and the expiry on a copy: a long path costs once, not per sandbox."""
    prefix = hashlib.sha256(f"{path}:{operation}:{user}:".encode())
    tail = f":{expiration}".encode() if expiration is not None else b""
    want = given.encode()
    for sandbox_id in sandbox_ids:
        h = prefix.copy()
        h.update(access_token(manager, sandbox_id).encode() + tail)
        if hmac.compare_digest(want, b"v1_" + base64.b64encode(h.digest()).rstrip(b"=")):
            return sandbox_id
    return None
