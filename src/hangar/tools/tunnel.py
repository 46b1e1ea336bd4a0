"""A local TCP port that reaches a TCP port inside a sandbox.

``LocalTunnel`` listens on ``127.0.0.1:<ephemeral>``; each connection
accepted there opens one WebSocket to the server's
``/sandboxes/{id}/tunnel/{port}`` (``hangar.api.tunnel``, authenticated by
the ``X-API-Key`` header) and carries bytes both ways until either side
closes. The browser tier points Playwright's ``connect_over_cdp`` at
``http://127.0.0.1:<local port>``: Chromium builds its
``webSocketDebuggerUrl`` from the Host header, so the DevTools WebSocket
comes back through the same local port.

Only this process's loopback listens; the key stays in headers.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

log = logging.getLogger("hangar.tools.tunnel")


class LocalTunnel:
    """Forward ``127.0.0.1:self.port`` to ``guest_port`` in ``sandbox_id``.

    Use ``await start()`` then ``await close()`` (or ``async with``).
    """

    def __init__(self, ws_url: str, headers: dict[str, str], sandbox_id: str,
                 guest_port: int) -> None:
        self.url = f"{ws_url}/sandboxes/{sandbox_id}/tunnel/{guest_port}"
        self.headers = headers
        self.port = 0
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> "LocalTunnel":
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def start(self) -> int:
        """Listen; returns the local port."""
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        """Stop listening and end every forwarded connection."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for t in list(self._conns):
            t.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            await self._forward(reader, writer)
        except asyncio.CancelledError:
            pass
        finally:
            self._conns.discard(task)
            writer.close()

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            ws = await connect(self.url, additional_headers=self.headers, max_size=None,
                               open_timeout=30, ping_interval=20, ping_timeout=60)
        except (InvalidStatus, OSError, asyncio.TimeoutError) as exc:
            log.warning("tunnel refused", extra={"url": self.url, "error": str(exc)})
            return
        async with ws:
            async def up() -> None:
                while data := await reader.read(65536):
                    await ws.send(data)

            async def down() -> None:
                async for msg in ws:
                    writer.write(msg if isinstance(msg, bytes) else msg.encode())
                    await writer.drain()

            tasks = [asyncio.create_task(up()), asyncio.create_task(down())]
            try:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                pass
            finally:
                for t in tasks:
                    t.cancel()
                results = await asyncio.gather(*tasks, return_exceptions=True)
                for r in results:
                    if isinstance(r, Exception) and not isinstance(
                            r, (ConnectionClosed, ConnectionError, asyncio.CancelledError)):
                        log.warning("tunnel connection failed", extra={"error": repr(r)})
