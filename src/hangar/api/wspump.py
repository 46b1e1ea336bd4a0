"""Pumps between an accepted WebSocket and what it carries (a guest tunnel, a terminal).

``supervise`` runs the two halves of a pump (client → far side, far side →
client) until either ends, then cancels the other, releases the far side
and closes the WebSocket with the code the halves left in ``close``
(``{"code": 1000, "reason": ""}`` unless one set another). A half that
fails with anything but a dropped connection (``WebSocketDisconnect``,
``HangarError``, ``ConnectionError``, ``RuntimeError``) is logged and the
WebSocket closes with 1011.

``pump_stream`` is the pump for a byte stream in the guest
(``SandboxManager.tunnel``): binary frames both ways, text frames refused
(close 1003). Used by ``hangar.api.tunnel`` and ``hangar.api.vnc``;
``hangar.api.pty`` brings its own halves to ``supervise``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import WebSocket
from starlette.websockets import WebSocketDisconnect, WebSocketState

from hangar.core.service import race
from hangar.errors import HangarError

INBOUND_SLICE = 16 << 10
"""Bytes of a client's message given to ``pump_stream``'s ``inbound`` filter between two
turns of the loop: a 4 MiB VNC message of 6-byte pointer events held the loop 1.4 s in
one go (review 29i I-H3); the filters are incremental, so slices change nothing else."""

DROPPED = (WebSocketDisconnect, HangarError, ConnectionError, RuntimeError)
"""What a half may end with when either side goes away: not logged as a failure."""


class ByteStream(Protocol):
    """The far side of ``pump_stream`` (``hangar.core.commands.Tunnel``)."""

    async def read(self) -> bytes:
        """Next bytes; ``b""`` once the far side has closed."""
        ...

    async def write(self, data: bytes) -> None: ...

    async def close(self) -> None: ...


class Refuse(Exception):
    """Raised by ``pump_stream``'s ``inbound`` filter: close the WebSocket with ``code``
    and ``reason`` (at most 123 bytes of UTF-8 on the wire)."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


@dataclass
class Traffic:
    """Bytes a ``pump_stream`` carried: ``bytes_in`` from the client, ``bytes_out`` to it."""

    bytes_in: int = 0
    bytes_out: int = 0


async def supervise(ws: WebSocket, halves: Sequence[Callable[[], Awaitable[None]]],
                    close: dict[str, Any], release: Callable[[], Awaitable[None]], *,
                    log: logging.Logger, failed: str, reason: str,
                    extra: Mapping[str, object]) -> None:
    """Run ``halves`` until one returns or fails; then cancel the rest, await ``release``
    and close ``ws`` (if both ends still hold it open) with ``close``'s code and reason.

    An unexpected failure is logged as ``failed`` (with ``extra`` and the error) and
    closes with 1011 and ``reason``.
    """
    try:
        for task in await race(asyncio.ensure_future(half()) for half in halves):
            exc = task.exception()
            if exc is not None and not isinstance(exc, DROPPED):
                log.error(failed, extra={**extra, "error": repr(exc)})
                close.update(code=1011, reason=reason)
    finally:
        await release()
        if ws.application_state == WebSocketState.CONNECTED \
                and ws.client_state == WebSocketState.CONNECTED:
            try:
                await ws.close(**close)
            except (WebSocketDisconnect, RuntimeError, ConnectionError):
                pass  # the client went away first (Starlette raises WebSocketDisconnect)


async def pump_stream(ws: WebSocket, stream: ByteStream, *, log: logging.Logger, failed: str,
                      reason: str, extra: Mapping[str, object], binary_only: str,
                      inbound: Callable[[bytes], bytes] | None = None,
                      far_closed: tuple[int, str] | None = None,
                      traffic: Traffic | None = None) -> None:
    """Carry binary frames between ``ws`` and ``stream`` until either ends; close both.

    A text frame closes with 1003 and ``binary_only``. ``inbound`` may rewrite
    (or drop, returning ``b""``) what the client sends, or raise ``Refuse``.
    When ``stream`` ends first, the close is ``far_closed`` (code, reason), or
    1000. ``traffic`` counts the bytes as they pass. See ``supervise`` for
    ``log``, ``failed``, ``reason`` and ``extra``.
    """
    close: dict[str, Any] = {"code": 1000, "reason": ""}
    counted = traffic if traffic is not None else Traffic()

    async def client_to_far() -> None:
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                return
            data = msg.get("bytes")
            if data is None:
                close.update(code=1003, reason=binary_only)
                return
            counted.bytes_in += len(data)
            for at in range(0, len(data), INBOUND_SLICE):  # a turn between slices
                if at:
                    await asyncio.sleep(0)
                piece = data[at:at + INBOUND_SLICE]
                if inbound is not None:
                    try:
                        piece = inbound(piece)
                    except Refuse as e:
                        close.update(code=e.code, reason=e.reason)
                        return
                if piece:
                    await stream.write(piece)

    async def far_to_client() -> None:
        while True:
            data = await stream.read()
            if not data:
                if far_closed is not None:
                    close.update(code=far_closed[0], reason=far_closed[1])
                return
            counted.bytes_out += len(data)
            await ws.send_bytes(data)

    await supervise(ws, [client_to_far, far_to_client], close, stream.close, log=log,
                    failed=failed, reason=reason, extra=extra)
