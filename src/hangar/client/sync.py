"""Synchronous client. Every method raises a ``hangar.errors`` class on failure."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx

from hangar.client import _core


class Hangar:
    """Blocking client for one Hangar server. Times are seconds."""

    def __init__(self, base_url: str | None = None, api_key: str | None = None,
                 timeout: float = 300.0) -> None:
        url, key = _core.resolve_config(base_url, api_key)
        self._http = httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=timeout)

    def __enter__(self) -> "Hangar":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            resp = self._http.request(method, path, **kw)
        except httpx.TransportError as exc:
            raise _core.unavailable(self._http.base_url, exc) from None
        _core.raise_for(resp)
        return resp

    def health(self) -> dict[str, Any]:
        return self._call("GET", "/health").json()

    def create(self, image: str | None = None, **opts: Any) -> dict[str, Any]:
        """Create a sandbox (``vcpus``, ``memory_mib``, ``disk_mib``, ``timeout``, ``metadata``)."""
        body = {k: v for k, v in {"image": image, **opts}.items() if v is not None}
        return self._call("POST", "/sandboxes", json=body).json()

    def list(self) -> list[dict[str, Any]]:
        return self._call("GET", "/sandboxes").json()["sandboxes"]

    def get(self, sandbox_id: str) -> dict[str, Any]:
        return self._call("GET", f"/sandboxes/{sandbox_id}").json()

    def set_timeout(self, sandbox_id: str, timeout: float) -> dict[str, Any]:
        """Make the sandbox expire ``timeout`` seconds from now (0: never)."""
        return (self._call("POST", f"/sandboxes/{sandbox_id}/timeout",
                              json={"timeout": timeout})).json()

    def delete(self, sandbox_id: str) -> None:
        self._call("DELETE", f"/sandboxes/{sandbox_id}")

    def exec(self, sandbox_id: str, command: str, *, args: list[str] | None = None,
             env: dict[str, str] | None = None, cwd: str | None = None,
             stdin: str | bytes | None = None, timeout: float | None = None) -> dict[str, Any]:
        """Run a command; returns ``stdout``, ``stderr``, ``exit_code`` and more."""
        body = _core.exec_body(command, args, env, cwd, stdin, timeout)
        return self._call("POST", f"/sandboxes/{sandbox_id}/exec", json=body).json()

    def exec_stream(self, sandbox_id: str, command: str, *, args: list[str] | None = None,
                    env: dict[str, str] | None = None, cwd: str | None = None,
                    stdin: str | bytes | None = None,
                    timeout: float | None = None) -> Iterator[dict[str, Any]]:
        """Yield NDJSON events: ``stdout``/``stderr`` chunks, then ``exit``."""
        body = _core.exec_body(command, args, env, cwd, stdin, timeout)
        try:
            with self._http.stream("POST", f"/sandboxes/{sandbox_id}/exec/stream",
                                   json=body) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    _core.raise_for(resp)
                for line in resp.iter_lines():
                    event = _core.parse_line(line)
                    if event is not None:
                        yield event
        except httpx.TransportError as exc:
            raise _core.unavailable(self._http.base_url, exc) from None

    def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> dict[str, Any]:
        return self._call("PUT", f"/sandboxes/{sandbox_id}/files",
                          params={"path": path, "mode": mode}, content=data).json()

    def read_file(self, sandbox_id: str, path: str) -> bytes:
        return self._call("GET", f"/sandboxes/{sandbox_id}/files", params={"path": path}).content

    def list_files(self, sandbox_id: str, path: str = "/root") -> list[dict[str, Any]]:
        return self._call("GET", f"/sandboxes/{sandbox_id}/files/list",
                          params={"path": path}).json()["entries"]

    def remove_file(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
        self._call("DELETE", f"/sandboxes/{sandbox_id}/files",
                   params={"path": path, "recursive": recursive})

    # -- desktop (sandboxes created with ``desktop="WxHxD"``); pixels ---------

    def screenshot(self, sandbox_id: str, width: int | None = None) -> bytes:
        """The screen as PNG bytes, scaled to ``width`` pixels when given."""
        params: dict[str, Any] = {"format": "png"}
        if width is not None:
            params["width"] = width
        return self._call("POST", f"/sandboxes/{sandbox_id}/screenshot", params=params).content

    def click(self, sandbox_id: str, x: int, y: int, button: str = "left",
              double: bool = False) -> dict[str, Any]:
        return self._desktop(sandbox_id, "click", x=x, y=y, button=button, double=double)

    def move(self, sandbox_id: str, x: int, y: int) -> dict[str, Any]:
        return self._desktop(sandbox_id, "move", x=x, y=y)

    def drag(self, sandbox_id: str, from_x: int, from_y: int, to_x: int, to_y: int,
             button: str = "left") -> dict[str, Any]:
        return self._desktop(sandbox_id, "drag", from_x=from_x, from_y=from_y, to_x=to_x,
                             to_y=to_y, button=button)

    def type(self, sandbox_id: str, text: str) -> dict[str, Any]:
        """Type any Unicode text exactly."""
        return self._desktop(sandbox_id, "type", text=text)

    def key(self, sandbox_id: str, keys: str) -> dict[str, Any]:
        """Press a key or combination, e.g. ``ctrl+shift+t`` or ``enter``."""
        return self._desktop(sandbox_id, "key", keys=keys)

    def scroll(self, sandbox_id: str, direction: str, amount: int = 3, x: int | None = None,
               y: int | None = None) -> dict[str, Any]:
        return self._desktop(sandbox_id, "scroll", direction=direction, amount=amount, x=x, y=y)

    def display(self, sandbox_id: str) -> dict[str, Any]:
        """Screen size and cursor position, pixels."""
        return self._call("GET", f"/sandboxes/{sandbox_id}/display").json()

    def vnc_ticket(self, sandbox_id: str, view_only: bool = False) -> dict[str, Any]:
        """A single-use ticket and the WebSocket path for a live VNC view."""
        return self._call("POST", f"/sandboxes/{sandbox_id}/vnc/tickets",
                          json={"view_only": view_only}).json()

    def _desktop(self, sandbox_id: str, action: str, **body: Any) -> dict[str, Any]:
        body = {k: v for k, v in body.items() if v is not None}
        return self._call("POST", f"/sandboxes/{sandbox_id}/{action}", json=body).json()
