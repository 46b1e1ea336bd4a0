# Generated from hangar/client/_async/ports.py by scripts/gen_sync.py: do not edit.
"""Exposed ports: the flat client's calls (``/sandboxes/{id}/ports``): reach a guest TCP
port over HTTP and WebSockets, list, read and close them.

Mixed into ``AsyncHangar``; its methods run on the flat client (``self``). Source of
``hangar/client/_sync/ports.py``.
"""

from __future__ import annotations

import builtins

from hangar.client import _core
from hangar.client._sync.mixin import flat_client as _client
from hangar.schemas import PortInfo


class PortCalls:
    """The flat client's port methods (mixed into ``AsyncHangar``)."""

    def expose(self, sandbox_id: str, port: int, public: bool = False, *,
                     token_ttl: float | None = None, request_timeout: float | None = None,
                     retry: bool | None = None) -> PortInfo:
        """``POST /sandboxes/{id}/ports``: reach a guest TCP port over HTTP and WebSockets.

        The answer's ``url`` is where to send requests: ``http(s)://<port>-<id>.<domain>/``
        when the server has a domain, else ``.../sandboxes/<id>/ports/<port>/``. A private
        port (the default) needs ``X-API-Key`` there, or its ``signed_url``, valid
        ``token_ttl`` seconds (server default 3600). Exposing a port again updates
        ``public``. Raises NotFound, Gone, Conflict (the sandbox is stopping or failed).
        """
        c = _client(self)
        t = c._t(request_timeout, c.config.timeouts.control)
        return PortInfo.model_validate(c._json(
            "POST", f"/sandboxes/{sandbox_id}/ports",
            json=_core.drop_none(port=port, public=public, token_ttl=token_ttl),
            timeout=t, retry=retry is not False))

    def ports(self, sandbox_id: str, *, token_ttl: float | None = None,
                    request_timeout: float | None = None,
                    retry: bool | None = None) -> builtins.list[PortInfo]:
        """``GET /sandboxes/{id}/ports``: the exposed ports, private ones with new signed URLs."""
        c = _client(self)
        t = c._t(request_timeout, c.config.timeouts.control)
        data = c._json("GET", f"/sandboxes/{sandbox_id}/ports",
                             params=_core.drop_none(token_ttl=token_ttl), timeout=t,
                             retry=retry is not False)
        return [PortInfo.model_validate(p) for p in data]

    def port(self, sandbox_id: str, port: int, *, token_ttl: float | None = None,
                   request_timeout: float | None = None, retry: bool | None = None) -> PortInfo:
        """``GET /sandboxes/{id}/ports/{port}``: one exposed port (a new signed URL when private).

        Raises NotFound when it is not exposed."""
        c = _client(self)
        t = c._t(request_timeout, c.config.timeouts.control)
        return PortInfo.model_validate(c._json(
            "GET", f"/sandboxes/{sandbox_id}/ports/{port}",
            params=_core.drop_none(token_ttl=token_ttl), timeout=t, retry=retry is not False))

    def close_port(self, sandbox_id: str, port: int, *,
                         request_timeout: float | None = None,
                         retry: bool | None = None) -> None:
        """``DELETE /sandboxes/{id}/ports/{port}``: stop exposing it; its URLs answer 404."""
        c = _client(self)
        t = c._t(request_timeout, c.config.timeouts.control)
        c._send("DELETE", f"/sandboxes/{sandbox_id}/ports/{port}", timeout=t,
                      retry=retry is not False)
