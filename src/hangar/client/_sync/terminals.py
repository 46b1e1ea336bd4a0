# Generated from hangar/client/_async/terminals.py by scripts/gen_sync.py: do not edit.
"""Terminals: the flat client's calls (``/sandboxes/{id}/pty``): programs on a
pseudo-terminal in the guest, their sessions and tickets, and attaching to one
(``AsyncTerminal``, in ``streams``).

Mixed into ``AsyncHangar``; its methods run on the flat client (``self``). Source of
``hangar/client/_sync/terminals.py``.
"""

from __future__ import annotations

import builtins
from collections.abc import Mapping, Sequence

from hangar.client import _core
from hangar.client._sync.mixin import flat_client as _client
from hangar.client._sync.streams import Terminal
from hangar.schemas import PtySession, PtySessionList, PtyTicket


class TerminalCalls:
    """The flat client's terminal (``pty_*``) methods (mixed into ``AsyncHangar``)."""

    def pty_open(self, sandbox_id: str, command: str | None = None, *,
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
        c = _client(self)
        body = _core.drop_none(command=command, args=list(args) if args is not None else None,
                               env=dict(env) if env else None, cwd=cwd, cols=cols, rows=rows,
                               grace=grace)
        t = c._t(request_timeout, c.config.timeouts.control)
        return PtySession.model_validate(c._json(
            "POST", f"/sandboxes/{sandbox_id}/pty", json=body, timeout=t, retry=bool(retry),
            idempotency_key=idempotency_key or (_core.new_idempotency_key() if retry else None)))

    def pty_list(self, sandbox_id: str, *, request_timeout: float | None = None,
                       retry: bool | None = None) -> builtins.list[PtySession]:
        """``GET /sandboxes/{id}/pty``: the sandbox's terminal sessions."""
        c = _client(self)
        t = c._t(request_timeout, c.config.timeouts.control)
        return PtySessionList.model_validate(c._json(
            "GET", f"/sandboxes/{sandbox_id}/pty", timeout=t,
            retry=retry is not False)).sessions

    def pty_get(self, sandbox_id: str, session_id: str, *,
                      request_timeout: float | None = None,
                      retry: bool | None = None) -> PtySession:
        """``GET /sandboxes/{id}/pty/{session}``: one session's state. Raises NotFound."""
        c = _client(self)
        t = c._t(request_timeout, c.config.timeouts.control)
        return PtySession.model_validate(c._json(
            "GET", f"/sandboxes/{sandbox_id}/pty/{session_id}", timeout=t,
            retry=retry is not False))

    def pty_close(self, sandbox_id: str, session_id: str, *,
                        request_timeout: float | None = None,
                        retry: bool | None = None) -> None:
        """``DELETE /sandboxes/{id}/pty/{session}``: hang up the session's program."""
        c = _client(self)
        t = c._t(request_timeout, c.config.timeouts.control)
        c._send("DELETE", f"/sandboxes/{sandbox_id}/pty/{session_id}", timeout=t,
                      retry=retry is not False)

    def pty_ticket(self, sandbox_id: str, session_id: str, *,
                         request_timeout: float | None = None,
                         retry: bool | None = None) -> PtyTicket:
        """``POST /sandboxes/{id}/pty/{session}/tickets``: a single-use ticket (30 s) for
        the session's WebSocket."""
        c = _client(self)
        t = c._t(request_timeout, c.config.timeouts.control)
        return PtyTicket.model_validate(c._json(
            "POST", f"/sandboxes/{sandbox_id}/pty/{session_id}/tickets", timeout=t,
            retry=bool(retry)))

    def pty_attach(self, sandbox_id: str, session_id: str,
                         offset: int | None = None) -> Terminal:
        """Attach to a session over its WebSocket (``/sandboxes/{id}/pty/{session}``, with
        a fresh ticket), from output byte ``offset`` (None: what no viewer was sent)."""
        c = _client(self)
        return Terminal(c, sandbox_id, session_id).attach(offset)

    def terminal(self, sandbox_id: str, command: str | None = None, *,
                       args: Sequence[str] | None = None, env: Mapping[str, str] | None = None,
                       cwd: str | None = None, cols: int = 80, rows: int = 24,
                       grace: float | None = None) -> Terminal:
        """A new terminal session, attached: ``pty_open`` then ``pty_attach``."""
        c = _client(self)
        s = c.pty_open(sandbox_id, command, args=args, env=env, cwd=cwd, cols=cols,
                             rows=rows, grace=grace)
        return c.pty_attach(sandbox_id, s.id, offset=0)
