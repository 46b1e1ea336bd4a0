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
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import httpx
from httpx_sse import EventSource

from hangar.client import _core
from hangar.client._async._compat import sleep
from hangar.client._async.code import AsyncCodeCalls, OutputHandler
from hangar.client._async.desktop import AsyncDesktopCalls, Button, Direction
from hangar.client._async.machines import AsyncMachineCalls
from hangar.client._async.processes import AsyncProcessCalls
from hangar.client._async.streams import AsyncFileWatch, AsyncTerminal
from hangar.client._async.secrets import AsyncSecretCalls
from hangar.client._async.volumes import AsyncVolumeCalls
from hangar.client._core import RetryPolicy, Timeouts
from hangar.errors import HangarError, Unavailable
from hangar.schemas import (
    Event, ExecResult, ExecStreamEvent, FileEntry, FileList, Health, NetworkRules, PoolStatus,
    PortInfo, PtySession, PtySessionList, PtyTicket, SandboxInfo, SandboxList, Snapshot,
    SnapshotList, WriteResult,
)

__all__ = ["AsyncHangar", "Button", "Direction", "OutputHandler"]



class AsyncHangar(
        AsyncMachineCalls, AsyncDesktopCalls, AsyncCodeCalls, AsyncProcessCalls,
        AsyncVolumeCalls, AsyncSecretCalls):
    """A client of one Hangar server.

    ``base_url`` defaults to ``HANGAR_URL`` (else http://127.0.0.1:8080) and
    ``api_key`` to ``HANGAR_API_KEY`` (else the server's key file
    ``$HANGAR_DATA_DIR/api-key``); the key goes in the ``X-API-Key`` header.
    ``retry`` and ``timeouts`` set the defaults of every call.
    ``http_client`` lets the caller bring its own httpx client (a Unix-socket
    transport, a proxy, event hooks); the caller then closes it.

    Use it as a context manager, or call ``close()``. Groups of methods live in mixins:
    machines (``machines``, ``AsyncMachineCalls``), a desktop's screen and input
    (``desktop``, ``AsyncDesktopCalls``), the code interpreter (``code``,
    ``AsyncCodeCalls``), the ``process_*`` methods
    (background processes) in ``processes`` (``AsyncProcessCalls``), the volume
    methods (``create_volume``, ...) in ``volumes`` (``AsyncVolumeCalls``), the vault's
    (``create_secret``, ...) in ``secrets`` (``AsyncSecretCalls``).
    """

    def __init__(self, base_url: str | None = None, api_key: str | None = None, *,
                 retry: RetryPolicy | None = None, timeouts: Timeouts | None = None,
                 http_client: httpx.AsyncClient | None = None) -> None:
        self.config = _core.resolve_config(base_url, api_key, retry, timeouts)
        self._own_http = http_client is None
        self._http = http_client or httpx.AsyncClient()

    @property
    def base_url(self) -> str:
        """The server's URL, without a trailing slash."""
        return self.config.base_url

    async def __aenter__(self) -> AsyncHangar:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connections (not an ``http_client`` the caller passed in)."""
        if self._own_http:
            await self._http.aclose()

    # -- transport --------------------------------------------------------------------------

    async def _send(self, method: str, path: str, *, timeout: float, retry: bool,
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
                resp = await self._http.send(request, stream=stream)
            except httpx.TransportError as exc:
                error = _core.transport_error(self.base_url, exc, timeout)
            else:
                if resp.status_code < 400:
                    return resp
                if resp.status_code == 404 and method == "DELETE" and attempt > 0:
                    return resp  # an earlier attempt deleted it; its answer was lost
                if stream:
                    await resp.aread()
                    await resp.aclose()
                error = _core.error_for(resp)
            delay = _core.retry_delay(policy, attempt, error) if retry else None
            if delay is None:
                raise error
            attempt += 1
            _core.log.warning("retrying %s %s in %g s (attempt %d of %d): %s", method, path,
                              delay, attempt + 1, policy.attempts, error.message)
            await sleep(delay)

    async def _json(self, method: str, path: str, *, timeout: float, retry: bool,
                    **kw: Any) -> Any:
        return (await self._send(method, path, timeout=timeout, retry=retry, **kw)).json()

    def _t(self, given: float | None, default: float) -> float:
        return default if given is None else given

    # -- operations -------------------------------------------------------------------------

    async def health(self, *, request_timeout: float | None = None,
                     retry: bool | None = None) -> Health:
        """``GET /health`` (needs no key): version, engine, sandbox count."""
        t = self._t(request_timeout, self.config.timeouts.health)
        return Health.model_validate(await self._json(
            "GET", "/health", timeout=t, retry=retry is not False))

    async def metrics(self, *, request_timeout: float | None = None,
                      retry: bool | None = None) -> str:
        """``GET /metrics``: Prometheus text exposition."""
        t = self._t(request_timeout, self.config.timeouts.control)
        return (await self._send("GET", "/metrics", timeout=t, retry=retry is not False)).text

    async def pool(self, *, request_timeout: float | None = None,
                   retry: bool | None = None) -> PoolStatus:
        """``GET /pool``: size wanted, VMs ready and starting, maximum age."""
        t = self._t(request_timeout, self.config.timeouts.control)
        return PoolStatus.model_validate(await self._json(
            "GET", "/pool", timeout=t, retry=retry is not False))

    # -- sandboxes --------------------------------------------------------------------------

    async def create(self, image: str | None = None, *, vcpus: int | None = None,
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
        return SandboxInfo.model_validate(await self._json(
            "POST", "/sandboxes", json=body, retry=retry is not False,
            idempotency_key=idempotency_key or _core.new_idempotency_key(),
            timeout=self._t(request_timeout, self.config.timeouts.lifecycle)))

    async def list(self, *, request_timeout: float | None = None,
                   retry: bool | None = None) -> builtins.list[SandboxInfo]:
        """``GET /sandboxes``: sandboxes that exist or failed, oldest first."""
        t = self._t(request_timeout, self.config.timeouts.control)
        return SandboxList.model_validate(await self._json(
            "GET", "/sandboxes", timeout=t, retry=retry is not False)).sandboxes

    async def get(self, sandbox_id: str, *, request_timeout: float | None = None,
                  retry: bool | None = None) -> SandboxInfo:
        """``GET /sandboxes/{id}``. Raises NotFound (unknown, deleted) or Gone (expired)."""
        t = self._t(request_timeout, self.config.timeouts.control)
        return SandboxInfo.model_validate(await self._json(
            "GET", f"/sandboxes/{sandbox_id}", timeout=t, retry=retry is not False))

    async def delete(self, sandbox_id: str, *, request_timeout: float | None = None,
                     retry: bool | None = None) -> None:
        """``DELETE /sandboxes/{id}``: end the VM and remove its files. Raises NotFound."""
        t = self._t(request_timeout, self.config.timeouts.lifecycle)
        await self._send("DELETE", f"/sandboxes/{sandbox_id}", timeout=t,
                         retry=retry is not False)

    async def set_timeout(self, sandbox_id: str, timeout: float, *,
                          request_timeout: float | None = None,
                          retry: bool | None = None) -> SandboxInfo:
        """``POST /sandboxes/{id}/timeout``: expire ``timeout`` seconds from now (0: never)."""
        t = self._t(request_timeout, self.config.timeouts.control)
        return SandboxInfo.model_validate(await self._json(
            "POST", f"/sandboxes/{sandbox_id}/timeout", json={"timeout": timeout},
            timeout=t, retry=bool(retry)))

    async def update_network(self, sandbox_id: str, *, allow: Sequence[str] | None = None,
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
        return NetworkRules.model_validate(await self._json(
            "PATCH", f"/sandboxes/{sandbox_id}/network", json=body, timeout=t,
            retry=retry is not False))

    # -- exec -------------------------------------------------------------------------------

    async def exec(self, sandbox_id: str, command: str, *, args: Sequence[str] | None = None,
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
        with the first result. Raises NotFound, Conflict, Timeout.
        """
        body = _core.exec_body(command, list(args) if args is not None else None, env, cwd,
                               stdin, timeout, max_output, show_command)
        t = self._t(request_timeout, self.config.timeouts.exec(timeout))
        return ExecResult.model_validate(await self._json(
            "POST", f"/sandboxes/{sandbox_id}/exec", json=body, timeout=t, retry=bool(retry),
            idempotency_key=_core.new_idempotency_key() if retry else None))

    async def exec_stream(self, sandbox_id: str, command: str, *,
                          args: Sequence[str] | None = None, env: Mapping[str, str] | None = None,
                          cwd: str | None = None, stdin: str | bytes | None = None,
                          timeout: float | None = None, show_command: bool = False,
                          request_timeout: float | None = None,
                          retry: bool | None = None) -> AsyncIterator[ExecStreamEvent]:
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
        resp = await self._send("POST", f"/sandboxes/{sandbox_id}/exec/stream", json=body,
                                timeout=t, retry=bool(retry), stream=True)
        try:
            async for line in resp.aiter_lines():
                if line.strip():
                    ev = ExecStreamEvent.model_validate_json(line)
                    if ev.type == "error":
                        raise _core.stream_error(ev.code, ev.message)
                    yield ev
        except httpx.TransportError as exc:
            raise _core.transport_error(self.base_url, exc, t) from None
        finally:
            await resp.aclose()

    # -- files ------------------------------------------------------------------------------

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644, *,
                         request_timeout: float | None = None,
                         retry: bool | None = None) -> WriteResult:
        """``PUT /sandboxes/{id}/files``: write ``data`` to ``path`` (atomic in the guest).

        Relative paths start at /root; ``mode`` is the file's permission
        bits. The timeout grows with the size. Raises NotFound, InvalidRequest.
        """
        t = self._t(request_timeout, self.config.timeouts.upload(len(data)))
        return WriteResult.model_validate(await self._json(
            "PUT", f"/sandboxes/{sandbox_id}/files", params={"path": path, "mode": mode},
            content=data, timeout=t, retry=retry is not False))

    async def read_file(self, sandbox_id: str, path: str, *, request_timeout: float | None = None,
                        retry: bool | None = None) -> bytes:
        """``GET /sandboxes/{id}/files``: a file's bytes. Raises NotFound, InvalidRequest."""
        t = self._t(request_timeout, self.config.timeouts.transfer)
        return (await self._send("GET", f"/sandboxes/{sandbox_id}/files",
                                 params={"path": path}, timeout=t,
                                 retry=retry is not False)).content

    async def list_files(self, sandbox_id: str, path: str = "/root", *,
                         request_timeout: float | None = None,
                         retry: bool | None = None) -> builtins.list[FileEntry]:
        """``GET /sandboxes/{id}/files/list``: a directory's entries."""
        t = self._t(request_timeout, self.config.timeouts.control)
        return FileList.model_validate(await self._json(
            "GET", f"/sandboxes/{sandbox_id}/files/list", params={"path": path}, timeout=t,
            retry=retry is not False)).entries

    async def stat_file(self, sandbox_id: str, path: str, *, request_timeout: float | None = None,
                        retry: bool | None = None) -> FileEntry:
        """``GET /sandboxes/{id}/files/stat``: one path's type, size, mode and time."""
        t = self._t(request_timeout, self.config.timeouts.control)
        return FileEntry.model_validate(await self._json(
            "GET", f"/sandboxes/{sandbox_id}/files/stat", params={"path": path}, timeout=t,
            retry=retry is not False))

    async def make_dir(self, sandbox_id: str, path: str, parents: bool = True, *,
                       request_timeout: float | None = None,
                       retry: bool | None = None) -> FileEntry:
        """``POST /sandboxes/{id}/files/mkdir``: create a directory (and its parents)."""
        t = self._t(request_timeout, self.config.timeouts.control)
        return FileEntry.model_validate(await self._json(
            "POST", f"/sandboxes/{sandbox_id}/files/mkdir",
            json={"path": path, "parents": parents}, timeout=t, retry=retry is not False))

    async def remove_file(self, sandbox_id: str, path: str, recursive: bool = False, *,
                          request_timeout: float | None = None,
                          retry: bool | None = None) -> None:
        """``DELETE /sandboxes/{id}/files``: remove a file, or a directory with ``recursive``."""
        t = self._t(request_timeout, self.config.timeouts.control)
        await self._send("DELETE", f"/sandboxes/{sandbox_id}/files",
                         params={"path": path, "recursive": recursive}, timeout=t,
                         retry=retry is not False)

    # -- snapshots --------------------------------------------------------------------------

    async def snapshot(self, sandbox_id: str, *, idempotency_key: str | None = None,
                       request_timeout: float | None = None,
                       retry: bool | None = None) -> Snapshot:
        """``POST /sandboxes/{id}/snapshot``: save memory, devices and disk; it keeps running.

        Raises Busy (a command runs; retry shortly) or Conflict.
        """
        t = self._t(request_timeout, self.config.timeouts.lifecycle)
        return Snapshot.model_validate(await self._json(
            "POST", f"/sandboxes/{sandbox_id}/snapshot", timeout=t, retry=retry is not False,
            idempotency_key=idempotency_key or _core.new_idempotency_key()))

    async def restore(self, sandbox_id: str, snapshot_id: str, *,
                      request_timeout: float | None = None,
                      retry: bool | None = None) -> SandboxInfo:
        """``POST /sandboxes/{id}/restore``: bring the sandbox back to one of its snapshots."""
        t = self._t(request_timeout, self.config.timeouts.lifecycle)
        return SandboxInfo.model_validate(await self._json(
            "POST", f"/sandboxes/{sandbox_id}/restore", json={"snapshot_id": snapshot_id},
            timeout=t, retry=bool(retry)))

    async def fork(self, snapshot_id: str, *, timeout: float | None = None,
                   metadata: Mapping[str, str] | None = None,
                   idempotency_key: str | None = None, request_timeout: float | None = None,
                   retry: bool | None = None) -> SandboxInfo:
        """``POST /snapshots/{id}/sandboxes``: a new sandbox started from a snapshot.

        ``timeout`` is its time to live, seconds.
        """
        body = _core.drop_none(timeout=timeout,
                               metadata=dict(metadata) if metadata is not None else None)
        t = self._t(request_timeout, self.config.timeouts.lifecycle)
        return SandboxInfo.model_validate(await self._json(
            "POST", f"/snapshots/{snapshot_id}/sandboxes", json=body, timeout=t,
            retry=retry is not False,
            idempotency_key=idempotency_key or _core.new_idempotency_key()))

    async def list_snapshots(self, sandbox_id: str | None = None, *,
                             request_timeout: float | None = None,
                             retry: bool | None = None) -> builtins.list[Snapshot]:
        """``GET /snapshots``: all snapshots, or those of one sandbox."""
        t = self._t(request_timeout, self.config.timeouts.control)
        params = {"sandbox_id": sandbox_id} if sandbox_id else None
        return SnapshotList.model_validate(await self._json(
            "GET", "/snapshots", params=params, timeout=t,
            retry=retry is not False)).snapshots

    async def get_snapshot(self, snapshot_id: str, *, request_timeout: float | None = None,
                           retry: bool | None = None) -> Snapshot:
        """``GET /snapshots/{id}``. Raises NotFound."""
        t = self._t(request_timeout, self.config.timeouts.control)
        return Snapshot.model_validate(await self._json(
            "GET", f"/snapshots/{snapshot_id}", timeout=t, retry=retry is not False))

    async def delete_snapshot(self, snapshot_id: str, *, request_timeout: float | None = None,
                              retry: bool | None = None) -> None:
        """``DELETE /snapshots/{id}``. Raises NotFound."""
        t = self._t(request_timeout, self.config.timeouts.control)
        await self._send("DELETE", f"/snapshots/{snapshot_id}", timeout=t,
                         retry=retry is not False)

    # -- exposed ports ----------------------------------------------------------------------

    async def expose(self, sandbox_id: str, port: int, public: bool = False, *,
                     token_ttl: float | None = None, request_timeout: float | None = None,
                     retry: bool | None = None) -> PortInfo:
        """``POST /sandboxes/{id}/ports``: reach a guest TCP port over HTTP and WebSockets.

        The answer's ``url`` is where to send requests: ``http(s)://<port>-<id>.<domain>/``
        when the server has a domain, else ``.../sandboxes/<id>/ports/<port>/``. A private
        port (the default) needs ``X-API-Key`` there, or its ``signed_url``, valid
        ``token_ttl`` seconds (server default 3600). Exposing a port again updates
        ``public``. Raises NotFound, Gone, Conflict (the sandbox is stopping or failed).
        """
        t = self._t(request_timeout, self.config.timeouts.control)
        return PortInfo.model_validate(await self._json(
            "POST", f"/sandboxes/{sandbox_id}/ports",
            json=_core.drop_none(port=port, public=public, token_ttl=token_ttl),
            timeout=t, retry=retry is not False))

    async def ports(self, sandbox_id: str, *, token_ttl: float | None = None,
                    request_timeout: float | None = None,
                    retry: bool | None = None) -> builtins.list[PortInfo]:
        """``GET /sandboxes/{id}/ports``: the exposed ports, private ones with new signed URLs."""
        t = self._t(request_timeout, self.config.timeouts.control)
        data = await self._json("GET", f"/sandboxes/{sandbox_id}/ports",
                                params=_core.drop_none(token_ttl=token_ttl), timeout=t,
                                retry=retry is not False)
        return [PortInfo.model_validate(p) for p in data]

    async def port(self, sandbox_id: str, port: int, *, token_ttl: float | None = None,
                   request_timeout: float | None = None, retry: bool | None = None) -> PortInfo:
        """``GET /sandboxes/{id}/ports/{port}``: one exposed port (a new signed URL when private).

        Raises NotFound when it is not exposed."""
        t = self._t(request_timeout, self.config.timeouts.control)
        return PortInfo.model_validate(await self._json(
            "GET", f"/sandboxes/{sandbox_id}/ports/{port}",
            params=_core.drop_none(token_ttl=token_ttl), timeout=t, retry=retry is not False))

    async def close_port(self, sandbox_id: str, port: int, *,
                         request_timeout: float | None = None,
                         retry: bool | None = None) -> None:
        """``DELETE /sandboxes/{id}/ports/{port}``: stop exposing it; its URLs answer 404."""
        t = self._t(request_timeout, self.config.timeouts.control)
        await self._send("DELETE", f"/sandboxes/{sandbox_id}/ports/{port}", timeout=t,
                         retry=retry is not False)

    # -- terminals (pty) --------------------------------------------------------------------

    async def pty_open(self, sandbox_id: str, command: str | None = None, *,
                       args: Sequence[str] | None = None, env: Mapping[str, str] | None = None,
                       cwd: str | None = None, cols: int = 80, rows: int = 24,
                       grace: float | None = None, idempotency_key: str | None = None,
                       request_timeout: float | None = None,
                       retry: bool | None = None) -> PtySession:
        """``POST /sandboxes/{id}/pty``: start a program on a pseudo-terminal in the guest.

        Without ``command``, a login shell; ``command`` is a shell string, or
        with ``args`` the program and its arguments. ``cols`` and ``rows`` are
        characters (1..1000); ``grace`` the seconds the session lives without a
        viewer (server default 60). Attach with ``pty_attach``, or use
        ``terminal`` to do both. Not retried unless ``retry=True`` (it starts a
        program; a retried call carries an ``Idempotency-Key``, so it starts
        once). Raises NotFound, Conflict, InvalidRequest, LimitExceeded (too
        many sessions in the sandbox).
        """
        body = _core.drop_none(command=command, args=list(args) if args is not None else None,
                               env=dict(env) if env else None, cwd=cwd, cols=cols, rows=rows,
                               grace=grace)
        t = self._t(request_timeout, self.config.timeouts.control)
        return PtySession.model_validate(await self._json(
            "POST", f"/sandboxes/{sandbox_id}/pty", json=body, timeout=t, retry=bool(retry),
            idempotency_key=idempotency_key or (_core.new_idempotency_key() if retry else None)))

    async def pty_list(self, sandbox_id: str, *, request_timeout: float | None = None,
                       retry: bool | None = None) -> builtins.list[PtySession]:
        """``GET /sandboxes/{id}/pty``: the sandbox's terminal sessions."""
        t = self._t(request_timeout, self.config.timeouts.control)
        return PtySessionList.model_validate(await self._json(
            "GET", f"/sandboxes/{sandbox_id}/pty", timeout=t,
            retry=retry is not False)).sessions

    async def pty_get(self, sandbox_id: str, session_id: str, *,
                      request_timeout: float | None = None,
                      retry: bool | None = None) -> PtySession:
        """``GET /sandboxes/{id}/pty/{session}``: one session's state. Raises NotFound."""
        t = self._t(request_timeout, self.config.timeouts.control)
        return PtySession.model_validate(await self._json(
            "GET", f"/sandboxes/{sandbox_id}/pty/{session_id}", timeout=t,
            retry=retry is not False))

    async def pty_close(self, sandbox_id: str, session_id: str, *,
                        request_timeout: float | None = None,
                        retry: bool | None = None) -> None:
        """``DELETE /sandboxes/{id}/pty/{session}``: hang up the session's program."""
        t = self._t(request_timeout, self.config.timeouts.control)
        await self._send("DELETE", f"/sandboxes/{sandbox_id}/pty/{session_id}", timeout=t,
                         retry=retry is not False)

    async def pty_ticket(self, sandbox_id: str, session_id: str, *,
                         request_timeout: float | None = None,
                         retry: bool | None = None) -> PtyTicket:
        """``POST /sandboxes/{id}/pty/{session}/tickets``: a single-use ticket (30 s) for
        the session's WebSocket."""
        t = self._t(request_timeout, self.config.timeouts.control)
        return PtyTicket.model_validate(await self._json(
            "POST", f"/sandboxes/{sandbox_id}/pty/{session_id}/tickets", timeout=t,
            retry=bool(retry)))

    async def pty_attach(self, sandbox_id: str, session_id: str,
                         offset: int | None = None) -> AsyncTerminal:
        """Attach to a session over its WebSocket (``/sandboxes/{id}/pty/{session}``, with
        a fresh ticket), from output byte ``offset`` (None: what no viewer was sent)."""
        return await AsyncTerminal(self, sandbox_id, session_id).attach(offset)

    async def terminal(self, sandbox_id: str, command: str | None = None, *,
                       args: Sequence[str] | None = None, env: Mapping[str, str] | None = None,
                       cwd: str | None = None, cols: int = 80, rows: int = 24,
                       grace: float | None = None) -> AsyncTerminal:
        """A new terminal session, attached: ``pty_open`` then ``pty_attach``."""
        s = await self.pty_open(sandbox_id, command, args=args, env=env, cwd=cwd, cols=cols,
                                rows=rows, grace=grace)
        return await self.pty_attach(sandbox_id, s.id, offset=0)

    # -- file watching ----------------------------------------------------------------------

    def watch_files(self, sandbox_id: str, path: str, recursive: bool = False, *,
                    request_timeout: float | None = None) -> AsyncFileWatch:
        """``GET /sandboxes/{id}/files/watch``: file changes under ``path``, as they happen.

        Returns an ``AsyncFileWatch``: ``async with`` it (the watch is in place
        once entered) and iterate ``FileEvent`` objects (``create``,
        ``modify``, ``delete``, ``move``, ``overflow``). ``recursive`` covers
        every folder below too. ``request_timeout`` is the longest silence
        tolerated (default 45 s; the server sends a keep-alive every 15 s).
        """
        t = self._t(request_timeout, self.config.timeouts.events)
        return AsyncFileWatch(self, sandbox_id, path, recursive, t)

    # -- live events ------------------------------------------------------------------------

    async def publish_event(self, kind: str, sandbox_id: str | None = None, *,
                            request_timeout: float | None = None, retry: bool | None = None,
                            **data: Any) -> Event:
        """``POST /events``: publish an agent platform's event to every listener.

        ``kind`` must start with ``agent.`` (e.g. ``agent.tool.started``);
        ``data`` holds JSON fields (at most 16 KiB), never secrets or file
        contents. Raises InvalidRequest for another kind or too much data.
        """
        body = {"kind": kind, "sandbox_id": sandbox_id, "data": data}
        t = self._t(request_timeout, self.config.timeouts.control)
        return Event.model_validate(await self._json("POST", "/events", json=body, timeout=t,
                                                     retry=bool(retry)))

    async def events(self, *, kinds: Sequence[str] = (), sandbox_id: str | None = None,
                     last_event_id: str | None = None, reconnect: bool = True,
                     request_timeout: float | None = None) -> AsyncIterator[Event]:
        """``GET /events`` (Server-Sent Events): yield live events as they happen, forever.

        ``kinds`` filters by kind or prefix (``exec`` matches
        ``exec.finished``); ``sandbox_id`` by sandbox. With
        ``last_event_id`` the server first replays what came after it (from
        its ring of recent events). When the connection breaks, the
        iterator reconnects with the last id it yielded, so nothing is
        missed, waiting the retry policy's delays; it raises once a
        reconnect has failed as many times in a row as the policy allows,
        or at once when ``reconnect`` is false. ``request_timeout`` is the
        longest silence before reconnecting (default 45 s; the server sends
        a keep-alive every 15 s). Stop by leaving the loop (and closing the
        iterator).
        """
        last = last_event_id
        params: dict[str, Any] = {}
        if kinds:
            params["kind"] = ",".join(kinds)
        if sandbox_id:
            params["sandbox_id"] = sandbox_id
        t = self._t(request_timeout, self.config.timeouts.events)
        policy = self.config.retry
        failures = 0
        while True:
            headers = {"Accept": "text/event-stream", "Cache-Control": "no-store"}
            if last is not None:
                headers["Last-Event-ID"] = last
            error: HangarError
            try:
                resp = await self._send("GET", "/events", params=params, headers=headers,
                                        timeout=t, retry=False, stream=True)
            except HangarError as exc:
                if not (reconnect and exc.retryable):
                    raise
                error = exc
            else:
                try:
                    async for sse in EventSource(resp).aiter_sse():
                        if not sse.data or sse.event not in ("", "message"):
                            continue
                        ev = Event.model_validate_json(sse.data)
                        last = ev.id
                        failures = 0
                        yield ev
                    error = Unavailable(f"the event stream of {self.base_url} ended")
                except httpx.TransportError as exc:
                    error = Unavailable(f"the event stream of {self.base_url} broke: "
                                        f"{exc or type(exc).__name__}")
                finally:
                    await resp.aclose()
                if not reconnect:
                    raise error
            if failures >= len(policy.delays):
                raise error
            delay = policy.delays[failures]
            failures += 1
            _core.log.warning("event stream: reconnecting in %g s: %s", delay, error.message)
            await sleep(delay)


