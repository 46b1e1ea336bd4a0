"""The vault: the flat client's calls (``/secrets``), mixed into ``AsyncHangar``.

A secret is stored once with the hosts it may be sent to, then given to sandboxes by
environment variable (``create(secrets={"GITHUB_TOKEN": "gh"})``): their guests see a
placeholder, which their egress proxy replaces with the value in HTTPS headers sent to
those hosts only. No call returns a value (docs/security.md, "Secrets and the vault").
Source of ``hangar/client/_sync/secrets.py``.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence

from hangar.client import _core
from hangar.client._async.mixin import flat_client as _client
from hangar.schemas import SecretInfo, SecretList


class AsyncSecretCalls:
    """The flat client's vault methods (mixed into ``AsyncHangar``)."""

    async def create_secret(self, name: str, value: str, hosts: Sequence[str], *,
                            request_timeout: float | None = None,
                            retry: bool | None = None) -> SecretInfo:
        """``POST /secrets``: store ``value`` (at most 8192 bytes, no control characters)
        as ``name``, to be sent to ``hosts`` only (names, or ``*.`` and a name). Carries a
        new idempotency key, so a retry never stores it twice. Raises InvalidRequest,
        Conflict (the name is taken: ``rotate_secret``)."""
        c = _client(self)
        return SecretInfo.model_validate(await c._json(
            "POST", "/secrets", json={"name": name, "value": value, "hosts": list(hosts)},
            retry=retry is not False, idempotency_key=_core.new_idempotency_key(),
            timeout=c._t(request_timeout, c.config.timeouts.control)))

    async def rotate_secret(self, name: str, value: str, hosts: Sequence[str] | None = None,
                            *, request_timeout: float | None = None,
                            retry: bool | None = None) -> SecretInfo:
        """``PUT /secrets/{name}``: a new value (and hosts; None keeps them); running
        sandboxes use it from their next request. Raises NotFound, InvalidRequest."""
        c = _client(self)
        body = _core.drop_none(value=value, hosts=list(hosts) if hosts is not None else None)
        return SecretInfo.model_validate(await c._json(
            "PUT", f"/secrets/{name}", json=body, retry=retry is not False,
            timeout=c._t(request_timeout, c.config.timeouts.control)))

    async def list_secrets(self, *, request_timeout: float | None = None,
                           retry: bool | None = None) -> builtins.list[SecretInfo]:
        """``GET /secrets``: every secret's name and hosts (never a value), by name."""
        c = _client(self)
        return SecretList.model_validate(await c._json(
            "GET", "/secrets", retry=retry is not False,
            timeout=c._t(request_timeout, c.config.timeouts.control))).secrets

    async def get_secret(self, name: str, *, request_timeout: float | None = None,
                         retry: bool | None = None) -> SecretInfo:
        """``GET /secrets/{name}``: its name and hosts (never its value). Raises NotFound."""
        c = _client(self)
        return SecretInfo.model_validate(await c._json(
            "GET", f"/secrets/{name}", retry=retry is not False,
            timeout=c._t(request_timeout, c.config.timeouts.control)))

    async def delete_secret(self, name: str, *, request_timeout: float | None = None,
                            retry: bool | None = None) -> None:
        """``DELETE /secrets/{name}``; sandboxes given it get its placeholder refused from
        then on. Raises NotFound."""
        c = _client(self)
        await c._send("DELETE", f"/secrets/{name}", retry=retry is not False,
                      timeout=c._t(request_timeout, c.config.timeouts.control))
