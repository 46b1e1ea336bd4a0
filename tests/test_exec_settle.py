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
import subprocess
import sys
import time
from pathlib import Path

from hangar.engines.agent_client import AgentClient, exec_meta, proc_meta, unix_channel
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


AGENT_WITH_A_LONG_SETTLE = (
    "import sys; import hangar.guest.ops.processes as p; p.START_SETTLE_S = 30.0; "
    "from hangar.guest.agent import main; main(['--listen', sys.argv[1]])")


def test_an_attached_start_is_announced_before_its_settle(tmp_path: Path) -> None:
    """A start with its client attached sends ``started`` as its process starts, then
    settles: with a settle of 30 s, a silent process's start still arrives at once (it
    arrived only at the settle's end before), and a short one's output and end follow."""
    path = tmp_path / "agent.sock"
    agent = subprocess.Popen([sys.executable, "-c", AGENT_WITH_A_LONG_SETTLE, str(path)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def go() -> None:
        while not path.exists():
            assert agent.poll() is None, "the agent ended"
            await asyncio.sleep(0.01)
        c = await AgentClient.handshake(unix_channel(path), 10)
        try:
            silent = await asyncio.wait_for(
                c.start_process_attached(proc_meta(argv=["sleep", "30"])), 10)
            await c.remove_process(silent.pid)  # a frame from the host ends the settle
            ev = await asyncio.wait_for(silent.next(), 10)
            assert ev is not None and ev.kind == "end" and ev.info is not None
            assert ev.info.signal == signal.SIGKILL

            short = await asyncio.wait_for(c.start_process_attached(
                proc_meta(argv=["/bin/sh", "-c", "printf out; exit 3"])), 10)
            got, end = b"", None
            while (ev := await asyncio.wait_for(short.next(), 10)) is not None:
                if ev.kind == "end":
                    end = ev.info
                else:
                    got += ev.data
            assert got == b"out" and end is not None and end.exit_code == 3
        finally:
            await c.close()

    try:
        asyncio.run(go())
    finally:
        agent.kill()
        agent.wait()


def test_a_frame_sent_at_once_takes_free_window_or_none() -> None:
    """``Outflow.take_now``: window only when it is free and no ``take`` waits before it."""
    async def go() -> None:
        out = P.Outflow(100)
        assert out.take_now(60) and out.available == 40
        assert not out.take_now(41) and out.available == 40
        waiter = asyncio.create_task(out.take(50))
        await asyncio.sleep(0)
        assert not out.take_now(10) and out.available == 40  # the waiting take goes first
        out.grant(60)
        await asyncio.wait_for(waiter, 10)
        assert out.available == 50
        out.fail(ConnectionError("gone"))
        assert not out.take_now(1)

    asyncio.run(go())
