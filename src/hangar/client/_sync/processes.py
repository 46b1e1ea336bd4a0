# Generated from hangar/client/_async/processes.py by scripts/gen_sync.py: do not edit.
"""Processes that outlive their connection: the flat calls and ``sandbox.processes``.

A background process is started by ``POST /sandboxes/{id}/processes`` and
lives on in the sandbox whatever its clients do: list it, attach to its
output (from now on, or from what its 1 MiB ring holds with ``replay``),
write to its stdin, signal or kill it by pid. A program an exec leaves
running (``server &``) shows here too (``origin="exec"``), with its output.

``AsyncProcessCalls`` holds the flat methods, one per route, which
``AsyncHangar`` inherits; ``AsyncProcesses`` is one sandbox's view
(``sandbox.processes``). Source of ``hangar/client/_sync/processes.py``.
"""

from __future__ import annotations

import base64
import builtins
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import httpx

from hangar.client import _core
from hangar.client._sync.mixin import flat_client as _client
from hangar.schemas import (
    ProcessEvent, ProcessInfo, ProcessInputResult, ProcessList, ProcessSignalResult,
)

if TYPE_CHECKING:
    from hangar.client._sync.client import Hangar


class ProcessCalls:
    """The flat client's process methods (mixed into ``AsyncHangar``)."""

    def process_start(self, sandbox_id: str, command: str, *,
                            args: Sequence[str] | None = None,
                            env: Mapping[str, str] | None = None, cwd: str | None = None,
                            tag: str | None = None, stdin: bool = False,
                            pty: tuple[int, int] | None = None, timeout: float | None = None,
                            request_timeout: float | None = None,
                            retry: bool | None = None) -> ProcessInfo:
        """``POST /sandboxes/{id}/processes``: start a process in the background.

        ``command`` is a shell string, or with ``args`` the program and its
        arguments. ``tag`` names it (unique among running processes);
        ``stdin`` gives it a pipe for ``process_stdin``; ``pty`` (cols, rows)
        runs it on a terminal; ``timeout`` kills its group after that many
        seconds. Not retried unless ``retry=True``. Raises InvalidRequest,
        Conflict (the tag is taken), LimitExceeded (64 processes run).
        """
        c = _client(self)
        body: dict[str, Any] = {"command": command, "stdin": stdin}
        if args is not None:
            body["args"] = list(args)
        if env:
            body["env"] = dict(env)
        if cwd:
            body["cwd"] = cwd
        if tag is not None:
            body["tag"] = tag
        if pty is not None:
            body["pty"] = {"cols": pty[0], "rows": pty[1]}
        if timeout is not None:
            body["timeout"] = timeout
        t = c._t(request_timeout, c.config.timeouts.control)
        return ProcessInfo.model_validate(c._json(
            "POST", f"/sandboxes/{sandbox_id}/processes", json=body, timeout=t,
            retry=bool(retry), idempotency_key=_core.new_idempotency_key() if retry else None))

    def process_list(self, sandbox_id: str, *,
                           request_timeout: float | None = None,
                           retry: bool | None = None) -> builtins.list[ProcessInfo]:
        """``GET /sandboxes/{id}/processes``: the sandbox's processes, running and exited,
        oldest first."""
        c = _client(self)
        t = c._t(request_timeout, c.config.timeouts.control)
        return ProcessList.model_validate(c._json(
            "GET", f"/sandboxes/{sandbox_id}/processes", timeout=t,
            retry=retry is not False)).processes

    def process_attach(self, sandbox_id: str, pid: int, *,
                             replay: bool = False, follow: bool = False,
                             request_timeout: float | None = None,
                             ) -> Iterator[ProcessEvent]:
        """``GET /sandboxes/{id}/processes/{pid}``: a process's output as it comes.

        Yields ``attached`` (its entry), then ``stdout``/``stderr``/``pty``
        events (``payload`` is the bytes) from now on, or with ``replay``
        first what its ring holds (``replay`` set on those), then ``end``
        with its final entry. ``follow`` keeps streaming after its exit while
        a program it left behind holds its output. Keep-alives are skipped.
        Leaving the loop detaches; the process runs on. ``request_timeout``
        is the longest silence tolerated (the server sends a keep-alive
        every 15 s). Raises NotFound, and an ``error`` line's class.
        """
        c = _client(self)
        t = c._t(request_timeout, c.config.timeouts.events)
        params = {"replay": "true" if replay else "false",
                  "follow": "true" if follow else "false"}
        resp = c._send("GET", f"/sandboxes/{sandbox_id}/processes/{pid}",
                                params=params, timeout=t, retry=True, stream=True)
        try:
            for line in resp.iter_lines():
                if not line.strip():
                    continue
                ev = ProcessEvent.model_validate_json(line)
                if ev.type == "keepalive":
                    continue
                if ev.type == "error":
                    raise _core.stream_error(ev.code, ev.message)
                yield ev
                if ev.type == "end":
                    return
        except httpx.TransportError as exc:
            raise _core.transport_error(c.base_url, exc, t) from None
        finally:
            resp.close()

    def process_stdin(self, sandbox_id: str, pid: int,
                            data: str | bytes = b"", *, close: bool = False,
                            request_timeout: float | None = None,
                            retry: bool | None = None) -> ProcessInputResult:
        """``POST /sandboxes/{id}/processes/{pid}/stdin``: write to its stdin (or terminal),
        in order (at most 1 MiB a call); ``close`` then closes its stdin. Raises NotFound,
        Conflict (its stdin is closed), Busy (it read none of it for 5 s)."""
        c = _client(self)
        body: dict[str, Any] = {"close": close}
        if isinstance(data, bytes):
            body["data_b64"] = base64.b64encode(data).decode()
        else:
            body["data"] = data
        t = c._t(request_timeout, c.config.timeouts.control)
        return ProcessInputResult.model_validate(c._json(
            "POST", f"/sandboxes/{sandbox_id}/processes/{pid}/stdin", json=body, timeout=t,
            retry=bool(retry)))

    def process_signal(self, sandbox_id: str, pid: int,
                             signal: int | str = "SIGTERM", *,
                             request_timeout: float | None = None,
                             retry: bool | None = None) -> ProcessSignalResult:
        """``POST /sandboxes/{id}/processes/{pid}/signal``: signal its process group (a
        number, or a name such as ``SIGTERM``); ``delivered`` is false when none of it
        was left. Raises NotFound, InvalidRequest."""
        c = _client(self)
        t = c._t(request_timeout, c.config.timeouts.control)
        return ProcessSignalResult.model_validate(c._json(
            "POST", f"/sandboxes/{sandbox_id}/processes/{pid}/signal",
            json={"signal": signal}, timeout=t, retry=bool(retry)))

    def process_resize(self, sandbox_id: str, pid: int, cols: int,
                             rows: int, *, request_timeout: float | None = None,
                             retry: bool | None = None) -> ProcessInfo:
        """``POST /sandboxes/{id}/processes/{pid}/resize``: a terminal process's new size,
        in characters. Raises NotFound, InvalidRequest (not on a terminal)."""
        c = _client(self)
        t = c._t(request_timeout, c.config.timeouts.control)
        return ProcessInfo.model_validate(c._json(
            "POST", f"/sandboxes/{sandbox_id}/processes/{pid}/resize",
            json={"cols": cols, "rows": rows}, timeout=t, retry=retry is not False))

    def process_kill(self, sandbox_id: str, pid: int, *,
                           request_timeout: float | None = None,
                           retry: bool | None = None) -> ProcessInfo:
        """``DELETE /sandboxes/{id}/processes/{pid}``: kill its process group (SIGKILL) if it
        runs and forget it; its last entry (exit code included). Raises NotFound."""
        c = _client(self)
        t = c._t(request_timeout, c.config.timeouts.control)
        return ProcessInfo.model_validate(c._json(
            "DELETE", f"/sandboxes/{sandbox_id}/processes/{pid}", timeout=t,
            retry=retry is not False))


class Processes:
    """Background processes of one sandbox (``sandbox.processes``); see the module
    docstring. Each method is the flat client's ``process_*`` for this sandbox."""

    def __init__(self, client: Hangar, sandbox_id: str) -> None:
        self._client = client
        self._id = sandbox_id

    def start(self, command: str, *, args: Sequence[str] | None = None,
                    env: Mapping[str, str] | None = None, cwd: str | None = None,
                    tag: str | None = None, stdin: bool = False,
                    pty: tuple[int, int] | None = None,
                    timeout: float | None = None) -> ProcessInfo:
        """Start a process in the background; its entry (``pid``)."""
        return self._client.process_start(self._id, command, args=args, env=env,
                                                cwd=cwd, tag=tag, stdin=stdin, pty=pty,
                                                timeout=timeout)

    def list(self) -> builtins.list[ProcessInfo]:
        """Every process of the sandbox's table, running and exited."""
        return self._client.process_list(self._id)

    def attach(self, pid: int, *, replay: bool = False,
                     follow: bool = False) -> Iterator[ProcessEvent]:
        """Its output events until ``end`` (see ``process_attach``)."""
        for ev in self._client.process_attach(self._id, pid, replay=replay,
                                                    follow=follow):
            yield ev

    def send_stdin(self, pid: int, data: str | bytes, *,
                         close: bool = False) -> ProcessInputResult:
        """Write to its stdin (or terminal); ``close`` then closes its stdin."""
        return self._client.process_stdin(self._id, pid, data, close=close)

    def close_stdin(self, pid: int) -> ProcessInputResult:
        """Close its stdin: it reads EOF."""
        return self._client.process_stdin(self._id, pid, b"", close=True)

    def signal(self, pid: int, signal: int | str = "SIGTERM") -> ProcessSignalResult:
        """Signal its process group."""
        return self._client.process_signal(self._id, pid, signal)

    def resize(self, pid: int, cols: int, rows: int) -> ProcessInfo:
        """Resize its terminal."""
        return self._client.process_resize(self._id, pid, cols, rows)

    def kill(self, pid: int) -> ProcessInfo:
        """Kill it (SIGKILL to its group) and forget it; its last entry."""
        return self._client.process_kill(self._id, pid)
