"""An exec that is the agent's one open request waits for its command's exit off the event
loop (``hangar.guest.spawn.Settle``), against real children and the real agent.

``Command`` with a ``Settle`` blocks in ``poll`` on the child's pidfd, its pipes and the
``wake`` fds: a command that ends within the budget comes back reaped with its output
read to the end; one that outlasts it, or a byte on a wake fd (the host sent a frame),
hands it to the event loop as before. Through the agent: a timeout shorter than the
budget still kills, and a SIGNAL frame reaches a command that has no stdin.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

from hangar.engines.agent_client import exec_meta
from hangar.guest import protocol as P
from hangar.guest import spawn
from hangar.guest.agent import Agent, serve_unix
from test_processes_agent import agent_here

ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}


def started(script: str, settle: spawn.Settle) -> tuple[spawn.Command, dict[str, bytes]]:
    """``sh -c script`` as the exec starts it, and what its sink got by stream."""
    out: dict[str, bytes] = {"stdout": b"", "stderr": b""}

    def sink(name: str, chunk: bytes) -> None:
        out[name] += chunk

    s = spawn.spawn(["/bin/sh", "-c", script], ENV, os.getcwd(), stdin_pipe=False)
    return spawn.Command(s.pid, s.stdin, s.stdout, s.stderr, sink, pidfd=s.pidfd,
                         writers=s.writers, settle=settle), out


def test_a_command_that_ends_within_the_budget_comes_back_reaped_and_read() -> None:
    async def go() -> None:
        cmd, out = started("printf out; printf err >&2; exit 3", spawn.Settle(30.0))
        # no await in between: it was waited for in the constructor
        assert cmd.returncode == 3 and cmd.exited.done()
        assert all(f.done() for f in cmd.eof.values())
        assert out == {"stdout": b"out", "stderr": b"err"}
        cmd.close()

    asyncio.run(go())


def test_output_larger_than_a_pipe_is_read_while_it_waits() -> None:
    """Not read meanwhile, the child would block on its full pipe and never exit."""
    async def go() -> None:
        cmd, out = started("head -c 1000000 /dev/zero; echo done >&2", spawn.Settle(30.0))
        assert cmd.returncode == 0
        assert len(out["stdout"]) == 1000000 and out["stderr"] == b"done\n"
        cmd.close()

    asyncio.run(go())


def test_a_command_past_the_budget_joins_the_event_loop() -> None:
    async def go() -> None:
        cmd, out = started("echo early; sleep 0.5; echo late", spawn.Settle(0.05))
        assert cmd.returncode is None
        assert await asyncio.wait_for(cmd.exited, 30) == 0
        await asyncio.wait_for(asyncio.gather(*cmd.eof.values()), 30)
        assert out["stdout"] == b"early\nlate\n"
        cmd.close()

    asyncio.run(go())


def test_a_started_process_waits_only_until_its_first_output() -> None:
    """``first_output`` (a ``proc_start`` with a client attached): its output goes out as it
    comes, so the wait ends at its first byte, long before its exit."""
    async def go() -> None:
        t0 = time.monotonic()
        cmd, out = started("printf first; sleep 30", spawn.Settle(30.0, first_output=True))
        assert time.monotonic() - t0 < 10  # not the budget of 30 s
        assert cmd.returncode is None and out["stdout"] == b"first"
        cmd.kill(signal.SIGKILL)
        assert await asyncio.wait_for(cmd.exited, 30) == -signal.SIGKILL
        cmd.close()

    asyncio.run(go())


def test_a_byte_from_the_host_ends_the_wait_at_once() -> None:
    async def go() -> None:
        r, w = os.pipe()
        os.write(w, b"x")  # the host has sent a frame
        try:
            cmd, _ = started("sleep 30", spawn.Settle(30.0, (r,)))
            assert cmd.returncode is None  # back without waiting for the command
            cmd.kill(signal.SIGKILL)
            assert await asyncio.wait_for(cmd.exited, 30) == -signal.SIGKILL
            cmd.close()
        finally:
            os.close(r)
            os.close(w)

    asyncio.run(go())


def test_a_timeout_shorter_than_the_wait_still_kills() -> None:
    async def go() -> None:
        async with agent_here() as (_, connect):
            c = await connect()
            r = await c.exec(exec_meta(argv=["sleep", "30"], timeout=0.1))
            assert r.timed_out and r.signal == signal.SIGKILL
            assert r.duration_s < 10  # killed, not run to its end
            r = await c.exec(exec_meta("echo fine"))
            assert (r.exit_code, r.stdout.head) == (0, b"fine\n")

    asyncio.run(go())


def test_a_signal_frame_reaches_a_command_without_stdin(tmp_path: Path) -> None:
    """Without stdin the exec reads its channel's frames with no task of its own
    (``Channel.listen``): a SIGNAL still ends the command."""
    async def go() -> None:
        path = tmp_path / "agent.sock"
        server = asyncio.create_task(serve_unix(Agent(), str(path)))
        try:
            while not path.exists():
                await asyncio.sleep(0.01)
            reader, writer = await asyncio.open_unix_connection(str(path))
            decoder = P.Decoder()

            async def frame() -> P.Frame:
                while True:
                    for f in decoder.feed(await asyncio.wait_for(reader.read(1 << 16), 30)):
                        return f

            assert (await frame()).kind == P.Kind.HELLO
            writer.write(P.encode(P.Kind.REQUEST, 1, {**exec_meta(argv=["sleep", "30"]),
                                                      "timeout": 60}))
            writer.write(P.encode(P.Kind.SIGNAL, 1, {"signal": signal.SIGTERM}))
            await writer.drain()
            answer = await frame()
            assert answer.kind == P.Kind.RESPONSE, answer.meta
            assert answer.meta["signal"] == signal.SIGTERM and not answer.meta["timed_out"]
            writer.close()
        finally:
            server.cancel()
            await asyncio.gather(server, return_exceptions=True)

    asyncio.run(go())
