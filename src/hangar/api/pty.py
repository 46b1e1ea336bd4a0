"""``/sandboxes/{id}/pty``: terminal sessions, and the WebSocket that carries one.

Flow::

    POST /sandboxes/{id}/pty {"cols", "rows", ...} (X-API-Key)        → {"id": "pty-…"}
    POST /sandboxes/{id}/pty/{session}/tickets (X-API-Key)            → {"ticket", "url"}
    WebSocket /sandboxes/{id}/pty/{session}?ticket=…[&offset=N]       → this module
        → hangar.core.terminals → the guest agent's ``pty`` op (hangar.guest.terminal)

Messages on the WebSocket:

=============  ==============  ==================================================================
direction      frame           content
=============  ==============  ==================================================================
server→client  text (first)    ``{"type": "attached", "session", "offset", "dropped", "cols",
                               "rows"}``: output follows from byte ``offset``; ``dropped`` bytes
                               asked for were no longer kept
server→client  binary          output bytes, in order
server→client  text (last)     ``{"type": "exit", "exit_code", "signal"}``, then close 1000
client→server  binary          input bytes (keys), at most ``MAX_INPUT_FRAME`` per frame
client→server  text            ``{"type": "resize", "cols": C, "rows": R}`` (1..1000)
=============  ==============  ==================================================================

A session outlives its WebSocket (``hangar.core.terminals``): attach again
with a new ticket, optionally with ``offset`` (the count of output bytes
already received) to get exactly what was missed. A second viewer takes
over: the first is closed with code 4000. Other closes: 1003 (a text frame
that is not a resize message), 1009 (an input frame over the limit), 1011
(a server error).

Refusals happen before the upgrade, as HTTP answers with Hangar's JSON
error body (``hangar.api.tickets``): 403 (Origin), 401 (ticket missing,
unknown, expired, used, or for another sandbox or session), 404 (no such
session), 400 (a bad ``offset``).
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response, WebSocket

from hangar.api.deps import manager
from hangar.api.tickets import TICKET_TTL_S, admit, deny, deny_error, tickets
from hangar.api.wspump import supervise
from hangar.core.service import Command, SandboxManager, Terminal
from hangar.errors import HangarError
from hangar.schemas import PTY_MAX_SIDE, PtyRequest, PtySession, PtySessionList, PtyTicket

log = logging.getLogger("hangar.pty")

MAX_INPUT_FRAME = 1 << 16
"""Bytes one client frame may carry (input, or a control message)."""

router = APIRouter(prefix="/sandboxes", tags=["terminal"])
"""Routes that need the API key."""
ws_router = APIRouter(prefix="/sandboxes", tags=["terminal"])
"""The WebSocket route, authenticated by a single-use ticket instead of the key."""
Manager = Annotated[SandboxManager, Depends(manager)]


def view(t: Terminal) -> PtySession:
    return PtySession(id=t.id, sandbox_id=t.sandbox_id, state=t.state,  # type: ignore[arg-type]
                      kind=t.kind, pid=t.pid, cols=t.cols,  # type: ignore[arg-type]
                      rows=t.rows, created_at=t.created_at, attached=t.viewer is not None,
                      output_bytes=t.end, grace=t.grace_s,
                      exit_code=t.exit.exit_code if t.exit else None)


@router.post("/{sandbox_id}/pty", response_model=PtySession, status_code=201,
             summary="Start a shell or a command on a pseudo-terminal; attach with a ticket")
async def open_pty(sandbox_id: str, m: Manager, body: PtyRequest | None = None) -> PtySession:
    body = body or PtyRequest()
    command = Command(body.command, body.args, env=body.env or None, cwd=body.cwd or None)
    return view(await m.terminals.open(sandbox_id, command, cols=body.cols, rows=body.rows,
                                       grace_s=body.grace))


@router.get("/{sandbox_id}/pty", response_model=PtySessionList,
            summary="List a sandbox's terminal sessions")
async def list_pty(sandbox_id: str, m: Manager) -> PtySessionList:
    m.get(sandbox_id)  # 404 / 410 for an unknown or expired sandbox
    return PtySessionList(sessions=[view(t) for t in m.terminals.list(sandbox_id)])


@router.get("/{sandbox_id}/pty/{session_id}", response_model=PtySession,
            summary="One terminal session: state, size, exit code")
async def get_pty(sandbox_id: str, session_id: str, m: Manager) -> PtySession:
    return view(m.terminals.get(sandbox_id, session_id))


@router.delete("/{sandbox_id}/pty/{session_id}", status_code=204,
               summary="Hang up a terminal session (SIGHUP, then SIGKILL) and forget it")
async def close_pty(sandbox_id: str, session_id: str, m: Manager) -> Response:
    await m.terminals.close(sandbox_id, session_id)
    return Response(status_code=204)


@router.post("/{sandbox_id}/pty/{session_id}/tickets", response_model=PtyTicket,
             status_code=201,
             summary="Get a single-use ticket (valid 30 s) to attach to a terminal session")
async def pty_ticket(sandbox_id: str, session_id: str, request: Request,
                     m: Manager) -> PtyTicket:
    t = m.terminals.get(sandbox_id, session_id)
    token, ticket = tickets(request.app).issue(sandbox_id, False, scope=f"pty:{t.id}")
    return PtyTicket(ticket=token, session_id=t.id, expires_at=ticket.expires_at,
                     expires_in_s=TICKET_TTL_S,
                     url=f"/sandboxes/{sandbox_id}/pty/{t.id}?ticket={token}")


@ws_router.websocket("/{sandbox_id}/pty/{session_id}")
async def attach(ws: WebSocket, sandbox_id: str, session_id: str, ticket: str | None = None,
                 offset: str | None = None) -> None:
    """Carry one viewer's terminal (see the module docstring)."""
    if await admit(ws, sandbox_id, f"pty:{session_id}", ticket,
                   "POST /sandboxes/{id}/pty/{session}/tickets") is None:
        return
    start: int | None = None
    if offset is not None:
        if not (offset.isascii() and offset.isdigit()) or len(offset) > 18:
            await deny(ws, 400, "invalid_request", "offset must be a count of output bytes")
            return
        start = int(offset)
    m: SandboxManager = ws.app.state.manager
    try:
        term = m.terminals.get(sandbox_id, session_id)
    except HangarError as e:
        await deny_error(ws, e)
        return
    await ws.accept()
    viewer = term.attach(start)
    log.info("terminal attached", extra={"sandbox_id": sandbox_id, "session": term.id,
                                         "offset": viewer.offset})
    close: dict[str, Any] = {"code": 1000, "reason": ""}

    async def to_client() -> None:
        await ws.send_text(json.dumps({
            "type": "attached", "session": term.id, "offset": viewer.offset,
            "dropped": viewer.dropped, "cols": term.cols, "rows": term.rows}))
        while True:
            chunk = await term.next(viewer)
            if chunk is not None:
                await ws.send_bytes(chunk)
                continue
            if viewer.taken_over:
                close.update(code=4000, reason="attached from another connection")
                return
            x = term.exit
            await ws.send_text(json.dumps({
                "type": "exit", "exit_code": x.exit_code if x else None,
                "signal": x.signal if x else None}))
            m.terminals.delivered_exit(term)
            return

    async def from_client() -> None:
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                return
            data, text = msg.get("bytes"), msg.get("text")
            size = len(data) if data is not None else len(text or "")
            if size > MAX_INPUT_FRAME:
                close.update(code=1009, reason=f"frames carry at most {MAX_INPUT_FRAME} bytes")
                return
            if data is not None:
                await term.write(data)
                continue
            try:
                ctl = json.loads(text or "")
                cols, rows = int(ctl["cols"]), int(ctl["rows"])
                if ctl.get("type") != "resize" or not (0 < cols <= PTY_MAX_SIDE
                                                        and 0 < rows <= PTY_MAX_SIDE):
                    raise ValueError
            except (ValueError, TypeError, KeyError, OverflowError):
                close.update(code=1003, reason="text frames carry resize messages only: "
                                               '{"type": "resize", "cols": C, "rows": R}')
                return
            await term.resize(cols, rows)

    async def detach() -> None:
        term.detach(viewer)

    try:
        await supervise(ws, [to_client, from_client], close, detach, log=log,
                        failed="terminal proxy failed", reason="terminal proxy error",
                        extra={"sandbox_id": sandbox_id})
    finally:
        log.info("terminal detached", extra={"sandbox_id": sandbox_id, "session": term.id,
                                             "offset": viewer.offset})
