"""What the sync and async clients share: configuration, requests, errors."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import httpx

from hangar.errors import BY_CODE, HangarError, LimitExceeded, Unavailable
from hangar.layout import Layout

DEFAULT_URL = "http://127.0.0.1:8080"


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    params: dict[str, Any] | None = None
    json: Any = None
    content: bytes | None = None


def resolve_config(base_url: str | None, api_key: str | None) -> tuple[str, str]:
    """URL and key from the arguments, ``HANGAR_URL``/``HANGAR_API_KEY``, or the
    server's key file (``$HANGAR_DATA_DIR/api-key``, default /var/lib/hangar)."""
    url = base_url or os.environ.get("HANGAR_URL") or DEFAULT_URL
    key = api_key or os.environ.get("HANGAR_API_KEY")
    if not key:
        path = Layout.from_env().api_key_file
        try:
            key = path.read_text().strip()
        except OSError:
            key = ""
    return url.rstrip("/"), key


def unavailable(url: object, exc: Exception) -> Unavailable:
    """The error for a server that could not be reached at ``url``."""
    return Unavailable(f"cannot reach Hangar at {url}: {exc or type(exc).__name__}; is "
                       "`hangar serve` running, and is HANGAR_URL right?")


def raise_for(resp: httpx.Response) -> None:
    """Raise the ``hangar.errors`` class matching an error response."""
    if resp.status_code < 400:
        return
    try:
        err = resp.json().get("error", {})
    except (ValueError, AttributeError):
        err = {}
    code = err.get("code", "")
    message = err.get("message") or f"HTTP {resp.status_code}"
    context = {k: v for k, v in err.items() if k not in ("code", "message")}
    if resp.status_code == 429:
        raise LimitExceeded(message, retry_after=float(resp.headers.get("Retry-After", 1)))
    cls = BY_CODE.get(code)
    if cls is None:
        cls = next((c for c in BY_CODE.values() if c.status == resp.status_code), HangarError)
    exc = cls(message, **context)
    exc.status = resp.status_code
    raise exc


def exec_body(command: str, args: list[str] | None, env: dict[str, str] | None,
              cwd: str | None, stdin: str | bytes | None, timeout: float | None) -> dict[str, Any]:
    body: dict[str, Any] = {"command": command}
    if args is not None:
        body["args"] = args
    if env:
        body["env"] = env
    if cwd:
        body["cwd"] = cwd
    if isinstance(stdin, bytes):
        import base64

        body["stdin_b64"] = base64.b64encode(stdin).decode()
    elif stdin is not None:
        body["stdin"] = stdin
    if timeout is not None:
        body["timeout"] = timeout
    return body


def parse_line(line: str) -> dict[str, Any] | None:
    line = line.strip()
    return json.loads(line) if line else None
