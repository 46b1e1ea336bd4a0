# Generated from hangar/client/_async/code.py by scripts/gen_sync.py: do not edit.
"""The code interpreter (a ``code-interpreter`` sandbox): ``run_code`` and its contexts;
the flat client's calls. See docs/sdk.md#code-interpreter.

Mixed into ``AsyncHangar``; its methods run on the flat client (``self``). Source of
``hangar/client/_sync/code.py``.
"""

from __future__ import annotations

import builtins
import inspect
import json as jsonlib
from collections.abc import Callable, Mapping
from typing import Any

import httpx

from hangar.client import _core
from hangar.client._sync.mixin import flat_client as _client
from hangar.client.execution import CodeContext, Execution, apply_line


OutputHandler = Callable[[Any], Any]
"""A ``run_code`` callback: given an ``OutputMessage``, ``Result`` or ``ExecutionError``."""


class CodeCalls:
    """The flat client's code interpreter methods (mixed into ``AsyncHangar``)."""

    # -- code interpreter (a ``code-interpreter`` sandbox) ---------------------------------

    def run_code(self,
                       sandbox_id: str, code: str, *, context: CodeContext | str | None = None,
                       language: str | None = None, envs: Mapping[str, str] | None = None,
                       timeout: float | None = None, on_stdout: OutputHandler | None = None,
                       on_stderr: OutputHandler | None = None,
                       on_result: OutputHandler | None = None,
                       on_error: OutputHandler | None = None,
                       request_timeout: float | None = None) -> Execution:
        """``POST /sandboxes/{id}/code/execute``: run a cell in the code interpreter.

        ``context`` (a ``CodeContext`` or its id; None: the default Python
        context, whose variables persist between calls); ``envs`` hold for
        this cell only; ``timeout`` (seconds, None: none) ends a cell that
        runs longer (its ``error`` is then named ``TimeoutError``). The
        callbacks get each ``OutputMessage``, ``Result`` or ``ExecutionError``
        as it arrives (plain functions, or coroutines in the asyncio client).
        Returns the ``Execution``; an exception in the cell is its ``error``,
        not raised. Raises ``Conflict`` (409 ``no_interpreter``) for a sandbox of
        another image, ``NotFound`` for an unknown context. Never retried.
        """
        c = _client(self)
        body = _core.drop_none(code=code, context_id=_context_id(context), language=language,
                               env_vars=dict(envs) if envs else None, timeout=timeout)
        t = c._t(request_timeout, c.config.timeouts.exec(timeout))
        resp = c._send("POST", f"/sandboxes/{sandbox_id}/code/execute", json=body,
                             timeout=t, retry=False, stream=True)
        execution = Execution()
        handlers = {"stdout": on_stdout, "stderr": on_stderr, "result": on_result,
                    "error": on_error}
        try:
            for line in resp.iter_lines():
                if not line.strip():
                    continue
                try:
                    data = jsonlib.loads(line)
                except ValueError:  # a line the server cut at its limit: an error line follows
                    continue
                got = apply_line(execution, data)
                if got is None or handlers[got[0]] is None:
                    continue
                handler = handlers[got[0]]
                if handler is not None:
                    maybe = handler(got[1])
                    if inspect.isawaitable(maybe):
                        maybe
        except httpx.TransportError as exc:
            raise _core.transport_error(c.base_url, exc, t) from None
        finally:
            resp.close()
        return execution

    def create_code_context(self, sandbox_id: str, *, cwd: str | None = None,
                                  language: str | None = None,
                                  request_timeout: float | None = None) -> CodeContext:
        """``POST /sandboxes/{id}/code/contexts``: a new context (a kernel of its own, in
        ``cwd``, default /root). Raises ``LimitExceeded`` past the server's 16 contexts."""
        c = _client(self)
        t = c._t(request_timeout, c.config.timeouts.lifecycle)
        data = c._json("POST", f"/sandboxes/{sandbox_id}/code/contexts",
                             json=_core.drop_none(cwd=cwd, language=language), timeout=t,
                             retry=False)
        return CodeContext(**data)

    def list_code_contexts(self,
                                 sandbox_id: str, *, request_timeout: float | None = None,
                                 retry: bool | None = None) -> builtins.list[CodeContext]:
        """``GET /sandboxes/{id}/code/contexts``: every context, the default one included."""
        c = _client(self)
        t = c._t(request_timeout, c.config.timeouts.control)
        data = c._json("GET", f"/sandboxes/{sandbox_id}/code/contexts", timeout=t,
                             retry=retry is not False)
        return [CodeContext(**c) for c in data]

    def restart_code_context(self,
                                   sandbox_id: str, context: CodeContext | str, *,
                                   request_timeout: float | None = None) -> None:
        """``POST /sandboxes/{id}/code/contexts/{cid}/restart``: a fresh kernel; its
        variables are gone."""
        c = _client(self)
        t = c._t(request_timeout, c.config.timeouts.lifecycle)
        c._send("POST", f"/sandboxes/{sandbox_id}/code/contexts/"
                              f"{_context_id(context)}/restart", timeout=t, retry=False)

    def remove_code_context(self, sandbox_id: str, context: CodeContext | str, *,
                                  request_timeout: float | None = None,
                                  retry: bool | None = None) -> None:
        """``DELETE /sandboxes/{id}/code/contexts/{cid}``: shut its kernel down."""
        c = _client(self)
        t = c._t(request_timeout, c.config.timeouts.control)
        c._send("DELETE", f"/sandboxes/{sandbox_id}/code/contexts/"
                                f"{_context_id(context)}", timeout=t, retry=bool(retry))


def _context_id(context: CodeContext | str | None) -> str | None:
    return context.id if isinstance(context, CodeContext) else context
