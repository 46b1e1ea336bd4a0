"""``AgentClient.handshake``, the one agent handshake, against the real guest agent.

The agent (``hangar.guest.agent``) serves a Unix socket on the host here, as
it serves its virtio-serial port or vsock in a guest; each engine only says
how to open its channel, so the handshake's retries, greeting, probing and
refusals are tested once, without a VM.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from hangar.engines.agent_client import AgentChannel, AgentClient, Streams, unix_channel
from hangar.errors import GuestError, Timeout
from hangar.guest import protocol as P
from hangar.guest.agent import Agent, serve_unix


@asynccontextmanager
async def agent_socket(delay: float = 0.0) -> AsyncIterator[Path]:
    """A real agent on a Unix socket that appears after ``delay`` seconds."""
    d = Path(tempfile.mkdtemp(prefix="hac-", dir="/tmp"))
    path = d / "agent.sock"

    async def serve() -> None:
        await asyncio.sleep(delay)
        await serve_unix(Agent(), str(path))

    task = asyncio.create_task(serve())
    try:
        while delay == 0 and not path.exists():
            await asyncio.sleep(0.01)
        yield path
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        shutil.rmtree(d, ignore_errors=True)


def test_waits_for_the_socket_then_greets() -> None:
    async def go() -> None:
        async with agent_socket(delay=0.4) as path:
            loop = asyncio.get_running_loop()
            t = loop.time()
            client = await AgentClient.handshake(unix_channel(path), 10)
            assert loop.time() - t >= 0.35
            assert client.hello["protocol"] == P.VERSION
            r = await client.exec({"op": "exec", "argv": ["echo", "hi"]})
            assert r.exit_code == 0 and r.stdout.head == b"hi\n"
            await client.close()

    asyncio.run(go())


def test_probe_greets_a_session_that_owes_no_hello() -> None:
    """A restored guest may keep its session: only the answer to ``hello`` greets."""
    async def greeted_session(path: Path) -> AgentChannel:
        """A stream whose HELLO the host already read (before the snapshot), offered once."""
        reader, writer = await asyncio.open_unix_connection(str(path))
        decoder = P.Decoder()
        while not any(f.kind == P.Kind.HELLO for f in decoder.feed(await reader.read(65536))):
            pass
        given = [(reader, writer)]

        async def once() -> Streams:
            if not given:
                raise GuestError("the held stream was opened twice")
            return given.pop()

        return AgentChannel(once)

    async def go() -> None:
        async with agent_socket() as path:
            with pytest.raises(Timeout):  # waiting for a HELLO alone never ends
                await AgentClient.handshake(await greeted_session(path), 0.8)
            channel = await greeted_session(path)
            probing = AgentChannel(channel.open, probe_interval=0.2)
            client = await AgentClient.handshake(probing, 5)
            assert client.hello["protocol"] == P.VERSION
            r = await client.exec({"op": "exec", "argv": ["true"]})
            assert r.exit_code == 0
            await client.close()

    asyncio.run(go())


def test_reopens_a_stream_that_closes_before_the_greeting() -> None:
    async def go() -> None:
        async with agent_socket() as path:
            opens = 0

            async def flaky() -> Streams:
                nonlocal opens
                opens += 1
                if opens < 3:  # a peer that hangs up at once, like a port being reopened
                    a, b = socket.socketpair()
                    b.close()
                    return await asyncio.open_connection(sock=a)
                return await asyncio.open_unix_connection(str(path))

            client = await AgentClient.handshake(AgentChannel(flaky), 5)
            assert opens == 3
            await client.close()

    asyncio.run(go())


def test_refuses_another_protocol_version_and_a_dead_vmm() -> None:
    async def go() -> None:
        a, b = socket.socketpair()
        b.sendall(P.encode(P.Kind.HELLO, 0, {"protocol": P.VERSION + 1}))
        r, w = await asyncio.open_connection(sock=a)
        given = [(r, w)]

        async def once() -> Streams:
            return given.pop()

        with pytest.raises(GuestError, match="protocol"):
            await AgentClient.handshake(AgentChannel(once), 5)
        assert w.is_closing()
        b.close()

        async def never() -> Streams:
            raise FileNotFoundError("no socket yet")

        loop = asyncio.get_running_loop()
        t = loop.time()
        with pytest.raises(GuestError, match="VMM exited"):
            await AgentClient.handshake(AgentChannel(never), 30, alive=lambda: loop.time() - t < 0.3)
        assert loop.time() - t < 5
        with pytest.raises(Timeout) as e:
            await AgentClient.handshake(AgentChannel(never), 0.3)
        assert "no socket yet" in e.value.context["last_error"]

    asyncio.run(go())
