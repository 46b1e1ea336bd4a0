"""The agent's transports: where the host's connections come from (standard library only).

=================  ==========================================================  ==================
transport          what                                                        chosen by
=================  ==========================================================  ==================
``serve_port``     the virtio-serial port named ``hangar.agent``               QEMU (the default)
                   (``/dev/vportNpM``), reopened whenever the host goes away
``serve_vsock``    AF_VSOCK port ``VSOCK_PORT``; each connection a session     ``hangar.channel=
                                                                               vsock`` (Firecracker)
``serve_unix``     a Unix socket, one host at a time                           ``--listen PATH``
                                                                               (tests on a host)
=================  ==========================================================  ==================

Each hands every host connection, as an asyncio (reader, writer) pair, to
``agent.session`` (``hangar.guest.agent.Agent``), which serves it to its end.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Coroutine
from typing import Protocol

from hangar.guest import protocol as P

PORT_NAME = "hangar.agent"
"""The virtio-serial port's name (QEMU: ``virtserialport,name=hangar.agent``)."""


class Server(Protocol):
    """What a transport serves: the agent."""

    async def session(self, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        """Serve one host connection until it closes."""
        ...


def find_port(name: str = PORT_NAME) -> str | None:
    """Path of the virtio-serial port called ``name``, or None."""
    base = "/sys/class/virtio-ports"
    try:
        ports = os.listdir(base)
    except OSError:
        return None
    for port in ports:
        try:
            with open(os.path.join(base, port, "name")) as f:
                if f.read().strip() == name:
                    return "/dev/" + port
        except OSError:
            continue
    return None


async def serve_port(agent: Server) -> None:
    """Serve the virtio-serial port, reopening it whenever the host goes away."""
    loop = asyncio.get_running_loop()
    while True:
        path = find_port()
        if path is None or not os.path.exists(path):
            await asyncio.sleep(0.05)
            continue
        try:
            rfd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:  # EBUSY while an earlier open is still closing
            print(f"hangar-agent: cannot open {path}: {exc}", file=sys.stderr, flush=True)
            await asyncio.sleep(0.2)
            continue
        wfd = os.dup(rfd)
        reader = asyncio.StreamReader(limit=P.MAX_DATA * 2)
        rtrans, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(rfd, "rb", buffering=0))
        wtrans, wproto = await loop.connect_write_pipe(
            asyncio.streams.FlowControlMixin, os.fdopen(wfd, "wb", buffering=0))
        writer = asyncio.StreamWriter(wtrans, wproto, None, loop)
        try:
            await agent.session(reader, writer)
        finally:
            # abort, not close: a write the absent host never read would
            # otherwise keep the port open (and busy) forever.
            # A transport that a write error already closed must not be aborted
            # again: asyncio's unix pipe transport would run its connection_lost
            # twice (``'NoneType' object has no attribute 'close'`` on the console).
            rtrans.close()
            if not wtrans.is_closing():
                wtrans.abort()
        await asyncio.sleep(0.05)  # host away: the port reads EOF until it returns


async def serve_unix(agent: Server, path: str) -> None:
    """Serve a Unix socket (one host at a time); used to test the agent on a host."""
    server = await asyncio.start_unix_server(agent.session, path=path, limit=P.MAX_DATA * 2)
    async with server:
        await server.serve_forever()


VSOCK_PORT = 52
"""The agent's vsock port under Firecracker (host side: ``CONNECT 52``)."""


def kernel_channel(path: str = "/proc/cmdline") -> str | None:
    """The value of ``hangar.channel=`` on the kernel command line, or None."""
    try:
        with open(path) as f:
            words = f.read().split()
    except OSError:
        return None
    for word in words:
        if word.startswith("hangar.channel="):
            return word.split("=", 1)[1]
    return None


async def serve_vsock(agent: Server, port: int = VSOCK_PORT) -> None:
    """Serve AF_VSOCK ``port`` (Firecracker's agent channel); each connection is a session.

    The host reaches it through Firecracker's Unix socket with ``CONNECT
    <port>``. Waits until the vsock transport exists (its modules load in
    the initramfs). After a snapshot restore the device resets and drops
    every connection, but this listening socket survives and the host
    simply connects again; the newest connection takes over the agent.
    """
    import socket

    warned = False
    while True:
        try:
            sock = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
        except OSError as exc:  # no vsock transport yet
            if not warned:
                print(f"hangar-agent: waiting for vsock: {exc}", file=sys.stderr, flush=True)
                warned = True
            await asyncio.sleep(0.05)
            continue
        try:
            sock.bind((socket.VMADDR_CID_ANY, port))
            sock.listen(8)
        except OSError as exc:
            sock.close()
            if not warned:
                print(f"hangar-agent: cannot listen on vsock port {port}: {exc}",
                      file=sys.stderr, flush=True)
                warned = True
            await asyncio.sleep(0.05)
            continue
        break
    sock.setblocking(False)
    server = await asyncio.start_server(agent.session, sock=sock, limit=P.MAX_DATA * 2)
    async with server:
        await server.serve_forever()


def serve(agent: Server, args: list[str]) -> Coroutine[None, None, None]:
    """The transport for the agent's command line ``args`` and the kernel's: ``--listen
    PATH`` a Unix socket, else vsock when ``hangar.channel=vsock``, else the virtio-serial
    port."""
    if len(args) == 2 and args[0] == "--listen":
        return serve_unix(agent, os.path.abspath(args[1]))
    if kernel_channel() == "vsock":
        return serve_vsock(agent)
    return serve_port(agent)
