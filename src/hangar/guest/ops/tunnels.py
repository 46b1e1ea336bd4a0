"""The ``connect`` operation: a TCP tunnel to a port inside the guest (e.g. x11vnc's 5900).

DATA frames of stream ``socket`` carry the bytes both ways, as each side's
window allows; EOF half-closes. The host's tunnels to exposed ports,
VNC and the browser's DevTools all ride on it.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from hangar.guest import protocol as P
from hangar.guest.ops.common import AgentView, OpError

if TYPE_CHECKING:
    from hangar.guest.channel import Channel


async def connect(agent: AgentView, meta: dict[str, Any], ch: Channel) -> dict[str, Any]:
    """Tunnel bytes between the channel and a TCP port in the guest.

    meta: ``port`` (int), ``host`` (default 127.0.0.1). The first DATA
    frame (empty, ``connected: true``) says the connection is open;
    ends with RESPONSE ``{bytes_in, bytes_out}`` when both sides closed.
    """
    port = meta.get("port")
    host = meta.get("host", "127.0.0.1")
    if not isinstance(port, int) or not 0 < port < 65536 or not isinstance(host, str):
        raise OpError("invalid", "connect needs a TCP port (1-65535)")
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
    except (OSError, asyncio.TimeoutError) as exc:
        raise OpError("not_found", f"cannot connect to {host}:{port}: {exc}") from None
    await ch.stream({"stream": "socket", "connected": True})
    counts = {"in": 0, "out": 0}

    async def upstream() -> None:
        while True:
            chunk = await reader.read(P.CHUNK)
            if not chunk:
                await ch.stream({"stream": "socket"}, kind=P.Kind.EOF)
                return
            counts["out"] += len(chunk)
            await ch.stream({"stream": "socket"}, chunk)  # waits for the host's window

    async def downstream() -> None:
        while True:
            frame = await ch.get()
            if frame.kind == P.Kind.DATA:
                counts["in"] += len(frame.data)
                writer.write(frame.data)
                await writer.drain()
            elif frame.kind in (P.Kind.EOF, P.Kind.SIGNAL):
                if writer.can_write_eof():
                    writer.write_eof()
                return

    up = asyncio.create_task(upstream())
    down = asyncio.create_task(downstream())
    try:
        done, pending = await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
        if down in done:  # host closed: let the guest side finish, briefly
            await asyncio.wait({up}, timeout=2)
        else:  # guest side closed: the host decides when to end
            await down
    except (ConnectionError, OSError):
        pass
    finally:
        for t in (up, down):
            t.cancel()
        writer.close()
    return {"bytes_in": counts["in"], "bytes_out": counts["out"]}
