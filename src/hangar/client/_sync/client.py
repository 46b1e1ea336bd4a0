# Generated from hangar/client/_async/client.py by scripts/gen_sync.py: do not edit.
"""The flat client: one method per REST route, typed results, safe retries.

This file is the one source of both clients: ``scripts/gen_sync.py``
generates ``hangar/client/_sync/client.py`` (``Hangar``) from it
(``AsyncHangar``), and a test fails when the generated file is stale.

Every method raises a ``hangar.errors`` class on failure and takes, keyword
only, ``request_timeout`` (seconds; see ``Timeouts`` for the defaults) and
``retry`` (None: the call's default, see ``RetryPolicy``).
"""

from __future__ import annotations

import builtins
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import httpx

from hangar.client import _core
from hangar.client._sync._compat import sleep
from hangar.client._sync.code import CodeCalls, OutputHandler
from hangar.client._sync.desktop import DesktopCalls, Button, Direction
from hangar.client._sync.events import EventCalls
from hangar.client._sync.files import FileCalls
from hangar.client._sync.machines import MachineCalls
from hangar.client._sync.ports import PortCalls
from hangar.client._sync.processes import ProcessCalls
from hangar.client._sync.secrets import SecretCalls
from hangar.client._sync.snapshots import SnapshotCalls
from hangar.client._sync.teams import TeamCalls
from hangar.client._sync.templates import TemplateCalls
from hangar.client._sync.terminals import TerminalCalls
from hangar.client._sync.volumes import VolumeCalls
from hangar.client._core import RetryPolicy, Timeouts
from hangar.schemas import (
    Capacity, ExecResult, ExecStreamEvent, Health, NetworkRules, PoolStatus, SandboxInfo,
    SandboxList,
)

__all__ = ["Hangar", "Button", "Direction", "OutputHandler"]


class Hangar(
        MachineCalls, DesktopCalls, CodeCalls, ProcessCalls,
        VolumeCalls, SecretCalls, FileCalls, SnapshotCalls,
        PortCalls, TerminalCalls, EventCalls, TemplateCalls,
        TeamCalls):
    """A client of one Hangar server.

    ``base_url`` defaults to ``HANGAR_URL`` (else http://127.0.0.1:8080) and
    ``api_key`` to ``HANGAR_API_KEY`` (else the server's key file
    ``$HANGAR_DATA_DIR/api-key``); the key goes in the ``X-API-Key`` header.
    ``retry`` and ``timeouts`` set the defaults of every call.
    ``http_client`` lets the caller bring its own httpx client (a Unix-socket
    transport, a proxy, event hooks); the caller then closes it.

    Use it as a context manager, or call ``close()``. This class holds the transport
    and the sandbox's own calls (create, list, get, delete, timeout, network, exec);
    the other groups of methods live in mixins, one module each: a sandbox's files
    (``files``, ``AsyncFileCalls``), snapshots (``snapshots``, ``AsyncSnapshotCalls``),
    exposed ports (``ports``, ``AsyncPortCalls``), terminals (the ``pty_*`` methods,
    ``terminals``, ``AsyncTerminalCalls``), live events (``events``,
    ``AsyncEventCalls``), machines (``machines``, ``AsyncMachineCalls``), a desktop's
    screen and input (``desktop``, ``AsyncDesktopCalls``), the code interpreter
    (``code``, ``AsyncCodeCalls``), background processes (the ``process_*`` methods,
    ``processes``, ``AsyncProcessCalls``), volumes (``volumes``, ``AsyncVolumeCalls``),
    the vault's secrets (``secrets``, ``AsyncSecretCalls``) and templates built from a
    Dockerfile (``build_template``, ``templates``, ``AsyncTemplateCalls``).
    Teams and their limits (``teams``, ``AsyncTeamCalls``) are for operator keys; with
    ``team`` (or ``HANGAR_TEAM``) an operator's key acts for that team (``X-Hangar-Team``:
    it sees and makes what a key of the team would).
    """

    def __init__(self, base_url: str | None = None, api_key: str | None = None, *,
                 retry: RetryPolicy | None = None, timeouts: Timeouts | None = None,
                 http_client: httpx.Client | None = None,
                 team: str | None = None) -> None:
        self.config = _core.resolve_config(base_url, api_key, retry, timeouts, team)
        self._own_http = http_client is None
        self._http = http_client or httpx.Client()

    @property
    def base_url(self) -> str:
        """The server's URL, without a trailing slash."""
        return self.config.base_url

    def __enter__(self) -> Hangar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connections (not an ``http_client`` the caller passed in)."""
        if self._own_http:
            self._http.close()

    # -- transport --------------------------------------------------------------------------

    def _send(self, method: str, path: str, *, timeout: float, retry: bool,
                    params: Mapping[str, Any] | None = None, json: Any = None,
                    content: bytes | None = None, idempotency_key: str | None = None,
                    headers: Mapping[str, str] | None = None,
                    stream: bool = False) -> httpx.Response:
        """Send one logical call, retrying it per the policy when ``retry`` is true."""
        policy = self.config.retry
        request = self._http.build_request(
            method, self.config.url(path), params=params, json=json, content=content,
            headers=self.config.headers(idempotency_key, headers),
            timeout=self.config.timeout(timeout))
        attempt = 0
        while True:
            resp: httpx.Response | None = None
            try:
                resp = self._http.send(request, stream=stream)
            except httpx.TransportError as exc:
                error = _core.transport_error(self.base_url, exc, timeout)
            else:
                if resp.status_code < 400:
                    return resp
                if resp.status_code == 404 and method == "DELETE" and attempt > 0:
                    return resp  # an earlier attempt deleted it; its answer was lost
                if stream:
                    resp.read()
                    resp.close()
                error = _core.error_for(resp)
            delay = _core.retry_delay(policy, attempt, error) if retry else None
            if delay is None:
                raise error
            attempt += 1
            _core.log.warning("retrying %s %s in %g s (attempt %d of %d): %s", method, path,
                              delay, attempt + 1, policy.attempts, error.message)
            sleep(delay)

    def _json(self, method: str, path: str, *, timeout: float, retry: bool,
                    **kw: Any) -> Any:
        return (self._send(method, path, timeout=timeout, retry=retry, **kw)).json()

    def _t(self, given: float | None, default: float) -> float:
        return default if given is None else given

    # -- operations -------------------------------------------------------------------------

    def health(self, *, request_timeout: float | None = None,
                     retry: bool | None = None) -> Health:
        """``GET /health`` (needs no key): version, engine, sandbox count."""
        t = self._t(request_timeout, self.config.timeouts.health)
        return Health.model_validate(self._json(
            "GET", "/health", timeout=t, retry=retry is not False))

    def metrics(self, *, request_timeout: float | None = None,
                      retry: bool | None = None) -> str:
        """``GET /metrics``: Prometheus text exposition."""
        t = self._t(request_timeout, self.config.timeouts.control)
        return (self._send("GET", "/metrics", timeout=t, retry=retry is not False)).text

    def pool(self, *, request_timeout: float | None = None,
                   retry: bool | None = None) -> PoolStatus:
        """``GET /pool``: size wanted, VMs ready and starting, maximum age."""
        t = self._t(request_timeout, self.config.timeouts.control)
        return PoolStatus.model_validate(self._json(
            "GET", "/pool", timeout=t, retry=retry is not False))

    def capacity(self, *, request_timeout: float | None = None,
                       retry: bool | None = None) -> Capacity:
        """``GET /capacity``: VMMs against their cap, starts in progress and queued
        against theirs (``starts``: running, limit, queued, queue, max_wait_s, waited,
        refused) and the host's memory (MiB: declared, allowed, used, available,
        headroom). Raises Forbidden (a team's key)."""
        t = self._t(request_timeout, self.config.timeouts.control)
        return Capacity.model_validate(self._json(
            "GET", "/capacity", timeout=t, retry=retry is not False))

    # -- sandboxes --------------------------------------------------------------------------

    def create(self, image: str | None = None, *, vcpus: int | None = None,
                     memory_mib: int | None = None, disk_mib: int | None = None,
                     timeout: float | None = None, metadata: Mapping[str, str] | None = None,
                     network: str | Mapping[str, Any] | None = None,
                     desktop: str | None = None, idempotency_key: str | None = None,
                     volumes: Mapping[str, Any] | None = None,
                     secrets: Mapping[str, str] | None = None,
                     request_timeout: float | None = None,
                     retry: bool | None = None) -> SandboxInfo:
        """``POST /sandboxes``: a running sandbox; answers once its guest agent is ready.

        ``image`` is a template name (default ``base``); ``memory_mib`` and
        ``disk_mib`` are MiB; ``timeout`` the time to live in seconds (0:
        none); ``network`` an egress policy; ``desktop`` a screen as
        ``WIDTHxHEIGHTxDEPTH``; ``volumes`` named volumes by guest path (a volume's
        id or name, or ``{"volume": ..., "read_only": True}``; docs/volumes.md);
        ``secrets`` vault secrets by environment variable (its guest sees placeholders;
        ``create_secret``). The call carries ``idempotency_key`` (a new one when None),
        so its retries never make a second sandbox. Raises LimitExceeded (cap reached),
        NotFound (no such image or volume), InvalidRequest, Conflict (a volume's writer
        is taken), EngineError or Timeout (the VM did not come up).
        """
        body = _core.drop_none(image=image, vcpus=vcpus, memory_mib=memory_mib,
                               disk_mib=disk_mib, timeout=timeout, network=network,
                               desktop=desktop,
                               volumes=dict(volumes) if volumes is not None else None,
                               secrets=dict(secrets) if secrets is not None else None,
                               metadata=dict(metadata) if metadata is not None else None)
        return SandboxInfo.model_validate(self._json(
            "POST", "/sandboxes", json=body, retry=retry is not False,
            idempotency_key=idempotency_key or _core.new_idempotency_key(),
            timeout=self._t(request_timeout, self.config.timeouts.lifecycle)))

    def list(self, *, request_timeout: float | None = None,
                   retry: bool | None = None) -> builtins.list[SandboxInfo]:
        """``GET /sandboxes``: sandboxes that exist or failed, oldest first."""
        t = self._t(request_timeout, self.config.timeouts.control)
        return SandboxList.model_validate(self._json(
            "GET", "/sandboxes", timeout=t, retry=retry is not False)).sandboxes

    def get(self, sandbox_id: str, *, request_timeout: float | None = None,
                  retry: bool | None = None) -> SandboxInfo:
        """``GET /sandboxes/{id}``. Raises NotFound (unknown, deleted) or Gone (expired)."""
        t = self._t(request_timeout, self.config.timeouts.control)
        return SandboxInfo.model_validate(self._json(
            "GET", f"/sandboxes/{sandbox_id}", timeout=t, retry=retry is not False))

    def delete(self, sandbox_id: str, *, request_timeout: float | None = None,
                     retry: bool | None = None) -> None:
        """``DELETE /sandboxes/{id}``: end the VM and remove its files. Raises NotFound."""
        t = self._t(request_timeout, self.config.timeouts.lifecycle)
        self._send("DELETE", f"/sandboxes/{sandbox_id}", timeout=t,
                         retry=retry is not False)

    def set_timeout(self, sandbox_id: str, timeout: float, *,
                          request_timeout: float | None = None,
                          retry: bool | None = None) -> SandboxInfo:
        """``POST /sandboxes/{id}/timeout``: expire ``timeout`` seconds from now (0: never)."""
        t = self._t(request_timeout, self.config.timeouts.control)
        return SandboxInfo.model_validate(self._json(
            "POST", f"/sandboxes/{sandbox_id}/timeout", json={"timeout": timeout},
            timeout=t, retry=bool(retry)))

    def update_network(self, sandbox_id: str, *, allow: Sequence[str] | None = None,
                             deny: Sequence[str] | None = None, egress: str | None = None,
                             request_timeout: float | None = None,
                             retry: bool | None = None) -> NetworkRules:
        """``PATCH /sandboxes/{id}/network``: replace the egress ``allow``/``deny`` lists
        (None keeps a list; entries are IPv4 CIDRs, domains such as ``*.example.com``, each
        optionally ``:port``) and optionally ``egress`` (``internet``/``open``). New
        connections see them within a second. Raises InvalidRequest (a bad entry),
        Conflict (the sandbox has no NIC, or ``egress='none'``), NotFound. Retried by
        default: the same lists twice are the same rules."""
        t = self._t(request_timeout, self.config.timeouts.control)
        body: dict[str, Any] = {}
        if allow is not None:
            body["allow"] = list(allow)
        if deny is not None:
            body["deny"] = list(deny)
        if egress is not None:
            body["egress"] = egress
        return NetworkRules.model_validate(self._json(
            "PATCH", f"/sandboxes/{sandbox_id}/network", json=body, timeout=t,
            retry=retry is not False))

    # -- exec -------------------------------------------------------------------------------

    def exec(self, sandbox_id: str, command: str, *, args: Sequence[str] | None = None,
                   env: Mapping[str, str] | None = None, cwd: str | None = None,
                   stdin: str | bytes | None = None, timeout: float | None = None,
                   max_output: int | None = None, show_command: bool = False,
                   request_timeout: float | None = None, retry: bool | None = None) -> ExecResult:
        """``POST /sandboxes/{id}/exec``: run a command to completion.

        ``command`` is a shell string (``/bin/sh -c``); with ``args`` it is
        the program and ``args`` its arguments, no shell. ``stdin`` is text
        or bytes; ``timeout`` the command's seconds (server default 60;
        the process group is then killed and ``timed_out`` set);
        ``max_output`` the bytes kept of each stream; ``show_command`` puts
        the command text in the live events. The call's own timeout is the
        command's plus a margin. Not retried unless ``retry=True`` (a
        command may have side effects); a retried exec carries an
        ``Idempotency-Key``, so the server runs it once and answers repeats
        with the first result (a result of over 64 KiB of JSON is not kept:
        a repeat of it raises Conflict). Raises NotFound, Conflict, Timeout.
        """
        body = _core.exec_body(command, list(args) if args is not None else None, env, cwd,
                               stdin, timeout, max_output, show_command)
        t = self._t(request_timeout, self.config.timeouts.exec(timeout))
        return ExecResult.model_validate(self._json(
            "POST", f"/sandboxes/{sandbox_id}/exec", json=body, timeout=t, retry=bool(retry),
            idempotency_key=_core.new_idempotency_key() if retry else None))

    def exec_stream(self, sandbox_id: str, command: str, *,
                          args: Sequence[str] | None = None, env: Mapping[str, str] | None = None,
                          cwd: str | None = None, stdin: str | bytes | None = None,
                          timeout: float | None = None, show_command: bool = False,
                          request_timeout: float | None = None,
                          retry: bool | None = None) -> Iterator[ExecStreamEvent]:
        """``POST /sandboxes/{id}/exec/stream``: yield output chunks as they come, then ``exit``.

        Arguments as for ``exec``. ``retry=True`` retries only the opening
        of the stream (before any output), never a stream cut midway. A call
        that fails midway (an ``error`` line: the guest stopped answering, or
        its connection was lost) raises the matching error (``Timeout``,
        ``GuestError``) after the output that came before it.
        """
        body = _core.exec_body(command, list(args) if args is not None else None, env, cwd,
                               stdin, timeout, None, show_command)
        t = self._t(request_timeout, self.config.timeouts.exec(timeout))
        resp = self._send("POST", f"/sandboxes/{sandbox_id}/exec/stream", json=body,
                                timeout=t, retry=bool(retry), stream=True)
        try:
            for line in resp.iter_lines():
                if line.strip():
                    ev = ExecStreamEvent.model_validate_json(line)
                    if ev.type == "error":
                        raise _core.stream_error(ev.code, ev.message)
                    yield ev
        except httpx.TransportError as exc:
            raise _core.transport_error(self.base_url, exc, t) from None
        finally:
            resp.close()
