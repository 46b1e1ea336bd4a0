"""Processes that outlive their connection, against the real guest agent on a Unix socket.

The agent (``hangar.guest.agent``) runs here in the test's own event loop,
as in ``test_agent_client``, so its process table (``hangar.guest.procs``)
can be looked at directly: a flood fills a ring of fixed size, a slow
client's queue is bounded, and a program an exec leaves behind keeps
writing without a broken pipe. ``test_processes.py`` runs the same through
the server and real VMs.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from hangar.engines.agent_client import AgentClient, ProcessStream, exec_meta, proc_meta, unix_channel
from hangar.errors import Conflict, GuestError, InvalidRequest, LimitExceeded, NotFound
from hangar.guest import procs
from hangar.guest.agent import Agent, serve_unix


@asynccontextmanager
async def agent_here() -> AsyncIterator[tuple[Agent, Callable[[], Awaitable[AgentClient]]]]:
    """A real agent on a Unix socket, and a way to open clients to it."""
    d = Path(tempfile.mkdtemp(prefix="hpa-", dir="/tmp"))
    path = d / "agent.sock"
    agent = Agent()
    task = asyncio.create_task(serve_unix(agent, str(path)))
    clients: list[AgentClient] = []

    async def connect() -> AgentClient:
        c = await AgentClient.handshake(unix_channel(path), 10)
        clients.append(c)
        return c

    try:
        while not path.exists():
            await asyncio.sleep(0.01)
        yield agent, connect
    finally:
        for c in clients:
            await c.close()
        for p in list(agent.procs.procs.values()):
            p.signal(9)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        shutil.rmtree(d, ignore_errors=True)


async def drain(stream: ProcessStream) -> tuple[bytes, list[str]]:
    """Every byte of a stream until its end, and the kinds of its events."""
    out, kinds = b"", []
    while (ev := await asyncio.wait_for(stream.next(), 30)) is not None:
        out += ev.data
        kinds.append(ev.kind)
    return out, kinds


def test_a_process_outlives_its_client_and_is_attached_again_by_pid() -> None:
    async def go() -> None:
        async with agent_here() as (_, connect):
            first = await connect()
            info = await first.start_process(proc_meta(
                "echo before; read line; echo got $line; read rest; exit 7",
                stdin=True, tag="job"))
            assert info.running and info.stdin_open and info.tag == "job"
            await first.close()  # the client leaves: the process runs on
            await asyncio.sleep(0.3)

            second = await connect()
            [entry] = [p for p in await second.list_processes() if p.pid == info.pid]
            assert entry.running and entry.cmd == "/bin/sh" and entry.args[0] == "-c"
            assert entry.output_bytes == len(b"before\n")
            stream = await second.attach_process(info.pid)  # from now on: no "before"
            assert await second.send_process_input(b"hi\n", pid=info.pid) == 3
            ev = await asyncio.wait_for(stream.next(), 10)
            assert ev is not None and (ev.kind, ev.data, ev.replay) == ("stdout", b"got hi\n",
                                                                        False)
            await stream.close()  # detach again: still running
            await asyncio.sleep(0.2)
            assert (await second.list_processes())[-1].running

            by_tag = await second.attach_process(tag="job", replay=True)
            await second.send_process_input(b"x\n", tag="job")
            out, kinds = await drain(by_tag)
            assert out == b"before\ngot hi\n" and kinds[-1] == "end"
            assert by_tag.ended is not None and by_tag.ended.exit_code == 7
            # The exit status is kept: listed, and attachable (the end at once).
            [entry] = [p for p in await second.list_processes() if p.pid == info.pid]
            assert (entry.running, entry.exit_code, entry.output_open) == (False, 7, False)
            out, kinds = await drain(await second.attach_process(info.pid))
            assert (out, kinds) == (b"", ["end"])

    asyncio.run(go())


def test_an_attached_start_waits_for_its_first_output_or_its_end() -> None:
    """A start with its client attached, the agent's one request, settles
    (``ops.processes.START_SETTLE_S``): a short command's output and end all arrive, none
    of it marked replayed; a long one's output as it comes, not at its end; a silent one's
    start within the wait."""
    async def go() -> None:
        async with agent_here() as (_, connect):
            c = await connect()
            stream = await c.start_process_attached(proc_meta(
                argv=["/bin/sh", "-c", "printf out; printf err >&2; exit 3"]))
            got: dict[str, bytes] = {}
            while (ev := await asyncio.wait_for(stream.next(), 30)) is not None:
                assert not ev.replay
                if ev.kind == "end":
                    assert ev.info is not None and ev.info.exit_code == 3
                else:
                    got[ev.kind] = got.get(ev.kind, b"") + ev.data
            assert got == {"stdout": b"out", "stderr": b"err"}

            t0 = time.monotonic()
            stream = await c.start_process_attached(proc_meta(
                argv=["/bin/sh", "-c", "echo first; exec sleep 30"]))
            ev = await asyncio.wait_for(stream.next(), 10)
            assert ev is not None and (ev.kind, ev.data) == ("stdout", b"first\n")
            assert time.monotonic() - t0 < 10  # not at its end, 30 s on
            await c.remove_process(stream.pid)

            silent = await asyncio.wait_for(c.start_process_attached(proc_meta(
                argv=["sleep", "30"])), 10)
            await c.remove_process(silent.pid)

    asyncio.run(go())


def test_stdin_close_signal_and_remove() -> None:
    async def go() -> None:
        async with agent_here() as (agent, connect):
            c = await connect()
            cat = await c.start_process(proc_meta(argv=["cat"], stdin=True))
            stream = await c.attach_process(cat.pid)
            await c.send_process_input(b"abc", pid=cat.pid)
            info = await c.close_process_stdin(pid=cat.pid)
            assert not info.stdin_open
            out, _ = await drain(stream)
            assert out == b"abc" and stream.ended is not None
            assert stream.ended.exit_code == 0
            with pytest.raises(Conflict):
                await c.send_process_input(b"more", pid=cat.pid)

            sleeper = await c.start_process(proc_meta(argv=["sleep", "60"]))
            assert (await c.signal_process(15, pid=sleeper.pid)).delivered is True
            await asyncio.sleep(0.3)
            [entry] = [p for p in await c.list_processes() if p.pid == sleeper.pid]
            assert (entry.exit_code, entry.signal) == (143, 15)
            assert not (await c.signal_process(15, pid=sleeper.pid)).delivered  # none left

            other = await c.start_process(proc_meta("sleep 60"))
            gone = await c.remove_process(pid=other.pid)
            assert (gone.running, gone.exit_code) == (False, 137)
            assert other.pid not in agent.procs.procs
            with pytest.raises(NotFound):
                await c.attach_process(other.pid)
            with pytest.raises(InvalidRequest):
                await c.signal_process(99, pid=cat.pid)

    asyncio.run(go())


def test_no_pipe_of_a_command_outlives_it() -> None:
    """The agent holds the write ends of a command's stdout and stderr until it is reaped
    (one wake-up per exit: ``spawn.Command``), and then closes them: after execs (captured,
    streamed, one that cannot start) and a started process that ended, it holds the fds it
    held before."""
    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    async def go() -> None:
        async with agent_here() as (agent, connect):
            c = await connect()
            await c.exec(exec_meta(argv=["true"]))  # what the agent keeps (/dev/null, its cwd)
            before = fds()
            for _ in range(3):
                r = await c.exec(exec_meta("echo out; echo err >&2; exit 3"))
                assert (r.exit_code, r.stdout.head, r.stderr.head) == (3, b"out\n", b"err\n")
            events = [ev async for ev in c.exec_stream(exec_meta("echo a; sleep 0.1; echo b",
                                                                 stream=True))]
            assert [ev.kind for ev in events][-1] == "exit"
            assert (await c.exec(exec_meta(argv=["/no/such/program"]))).exit_code == 127
            p = await c.start_process(proc_meta("echo started"))
            # replay: it may have ended before the attach; follow: to its output's end
            out, _ = await drain(await c.attach_process(p.pid, replay=True, follow=True))
            assert out == b"started\n"
            assert fds() == before

    asyncio.run(go())


def test_a_program_an_exec_leaves_behind_keeps_its_output() -> None:
    """The defect: ``server &`` in an exec got EPIPE on its first write after the exec
    returned. Now its pipes are read on, into the table's ring."""
    async def go() -> None:
        async with agent_here() as (_, connect):
            c = await connect()
            d = tempfile.mkdtemp(prefix="hpa-bg-", dir="/tmp")
            done = os.path.join(d, "done")
            script = ("import sys, time\n"
                      "for i in range(12):\n"
                      "    time.sleep(1.0 if i == 0 else 0.25)\n"
                      "    print('line', i, flush=True)\n"
                      "    print('log', i, file=sys.stderr, flush=True)\n"
                      f"open({done!r}, 'w').write('ok')\n")
            r = await c.exec(exec_meta(f"python3 -c \"{script}\" &"))
            assert r.exit_code == 0 and r.stdout.total == 0
            for _ in range(100):
                if os.path.exists(done):
                    break
                await asyncio.sleep(0.1)
            assert open(done).read() == "ok"  # it lived through every write (no EPIPE)
            [entry] = [p for p in await c.list_processes() if p.origin == "exec"]
            assert entry.exit_code == 0 and not entry.running
            out, _ = await drain(await c.attach_process(entry.pid, replay=True))
            assert out.count(b"line ") == 12 and out.count(b"log ") == 12
            shutil.rmtree(d, ignore_errors=True)

            # An exec that leaves nothing behind leaves no entry, nor does one whose group
            # was killed (its client left, its timeout passed).
            await c.exec(exec_meta("echo quick"))
            events = c.exec_stream(exec_meta("echo a; sleep 30 & sleep 30", stream=True))
            await anext(events)
            await events.aclose()
            r = await c.exec(exec_meta("echo b; sleep 30 & sleep 30", timeout=0.5))
            assert r.timed_out
            await asyncio.sleep(0.5)
            assert len(await c.list_processes()) == 1

    asyncio.run(go())


def test_a_flood_fills_the_ring_and_a_slow_client_holds_nothing_back() -> None:
    async def go() -> None:
        async with agent_here() as (agent, connect):
            c = await connect()
            stuck = c  # attaches and never reads
            info = await c.start_process(proc_meta("sleep 0.3; head -c 20000000 /dev/zero"))
            slow = await stuck.attach_process(info.pid)
            for _ in range(300):
                entry = agent.procs.procs[info.pid]
                if not entry.running and not entry.output_open:
                    break
                await asyncio.sleep(0.1)
            assert not entry.running, "the flood must not wait for the client that reads none"
            assert entry.ring is not None and entry.ring.size == procs.RING_BYTES
            [listed] = [p for p in await c.list_processes() if p.pid == info.pid]
            assert listed.output_bytes == 20_000_000
            assert listed.output_dropped == 20_000_000 - procs.RING_BYTES
            got = 0
            while (ev := await asyncio.wait_for(slow.next(), 30)) is not None:
                got += len(ev.data)
                if ev.kind == "end":
                    dropped = ev.dropped
            assert got + dropped == 20_000_000 and dropped > 0
            # what waited for it: at most its own queue and one window in flight
            assert got <= procs.ATTACH_BYTES + (2 << 20)

    asyncio.run(go())


def test_the_table_is_bounded_and_tags_are_unique_while_running() -> None:
    async def go() -> None:
        async with agent_here() as (agent, connect):
            c = await connect()
            first = await c.start_process(proc_meta("exit 4", tag="once"))
            await asyncio.sleep(0.2)
            for i in range(procs.MAX_PROCS - 1):
                await c.start_process(proc_meta(argv=["sleep", "60"], tag=f"s{i}"))
            with pytest.raises(Conflict):
                await c.start_process(proc_meta(argv=["sleep", "60"], tag="s0"))
            # the exited entry's slot is taken by the next start
            last = await c.start_process(proc_meta(argv=["sleep", "60"]))
            assert first.pid not in agent.procs.procs and last.pid in agent.procs.procs
            with pytest.raises(LimitExceeded, match="processes are running"):
                await c.start_process(proc_meta(argv=["sleep", "60"]))
            assert len(await c.list_processes()) == procs.MAX_PROCS
            await c.remove_process(tag="s5")
            await c.start_process(proc_meta(argv=["true"], tag="once"))  # room again

    asyncio.run(go())


def test_a_terminal_process_takes_input_and_a_new_size() -> None:
    async def go() -> None:
        async with agent_here() as (_, connect):
            c = await connect()
            stream = await c.start_process_attached(proc_meta(argv=["/bin/sh"], pty=(80, 24)))
            assert stream.info.pty and (stream.info.cols, stream.info.rows) == (80, 24)
            info = await c.resize_process(120, 40, pid=stream.pid)
            assert (info.cols, info.rows) == (120, 40)
            with pytest.raises(InvalidRequest):
                await c.close_process_stdin(pid=stream.pid)
            await c.send_process_input(b"stty size; exit 5\n", pid=stream.pid)
            out, kinds = await drain(stream)
            assert b"40 120" in out and set(kinds) == {"pty", "end"}
            assert stream.ended is not None and stream.ended.exit_code == 5
            with pytest.raises(InvalidRequest):
                pipe = await c.start_process(proc_meta("sleep 5"))
                await c.resize_process(10, 10, pid=pipe.pid)

    asyncio.run(go())


USER_PROBE = ("id -u; id -g; id -G; echo $HOME $USER $LOGNAME; pwd; "
              "grep -E '^(Uid|Gid|CapPrm|CapEff|CapAmb):' /proc/self/status")


@pytest.mark.skipif(os.geteuid() != 0, reason="the agent takes another user's ids as root")
def test_a_command_runs_as_the_user_the_request_names() -> None:
    """``user`` in exec and proc_start (pipes and a pty): the agent starts the command with
    that user's uid, gid and groups (as initgroups makes them), ``HOME``, ``USER`` and
    ``LOGNAME`` (under the request's env) and no capability, its home as the default cwd;
    its own ids are root's again after. An unknown user is a clear 400, never root; an
    agent whose HELLO lacks ``users`` (older) is sent no user at all."""
    import pwd

    pw = pwd.getpwnam("nobody")
    groups = " ".join(str(g) for g in os.getgrouplist("nobody", pw.pw_gid))
    want = (f"{pw.pw_uid}\n{pw.pw_gid}\n{groups}\n{pw.pw_dir} nobody nobody\n/tmp\n"
            f"Uid:\t{pw.pw_uid}\t{pw.pw_uid}\t{pw.pw_uid}\t{pw.pw_uid}\n"
            f"Gid:\t{pw.pw_gid}\t{pw.pw_gid}\t{pw.pw_gid}\t{pw.pw_gid}\n"
            "CapPrm:\t0000000000000000\nCapEff:\t0000000000000000\nCapAmb:\t0000000000000000\n")

    async def go() -> None:
        async with agent_here() as (agent, connect):
            c = await connect()
            r = await c.exec(exec_meta(argv=["/bin/sh", "-c", USER_PROBE], user="nobody",
                                       cwd="/tmp"))
            assert (r.exit_code, r.stdout.head.decode(), r.stderr.head) == (0, want, b"")
            r = await c.exec(exec_meta("echo $USER $HOME", user="nobody", cwd="/tmp",
                                       env={"HOME": "/tmp"}))  # the request's env wins
            assert r.stdout.head == b"nobody /tmp\n"
            assert (os.getresuid(), os.getresgid()) == ((0, 0, 0), (0, 0, 0))
            r = await c.exec(exec_meta(argv=["id", "-u"]))  # no user: root, as ever
            assert r.stdout.head == b"0\n"

            stream = await c.start_process_attached(proc_meta(
                argv=["/bin/sh", "-c", USER_PROBE], user="nobody", cwd="/tmp"))
            out, _ = await drain(stream)
            assert out.decode() == want
            [entry] = [p for p in await c.list_processes() if p.pid == stream.pid]
            assert (entry.cmd, entry.args) == ("/bin/sh", ["-c", USER_PROBE])  # as asked
            term = await c.start_process_attached(proc_meta(
                argv=["/bin/sh", "-c", "id -u; id -G"], user="nobody", cwd="/tmp",
                pty=(80, 24)))
            out, _ = await drain(term)
            assert out.replace(b"\r", b"") == f"{pw.pw_uid}\n{groups}\n".encode()

            # the home is the default cwd: nobody's does not exist, which is said
            with pytest.raises(InvalidRequest, match=f"cwd {pw.pw_dir}: no such directory"):
                await c.exec(exec_meta(argv=["true"], user="nobody"))
            for bad, says in (("no-such-user", "no user 'no-such-user' in the guest"),
                              ("", "is not a user name"), ("x" * 33, "is not a user name")):
                with pytest.raises(InvalidRequest, match=says):
                    await c.exec(exec_meta(argv=["touch", "/tmp/hpa-never"], user=bad))
                with pytest.raises(InvalidRequest, match=says):
                    await c.start_process(proc_meta(argv=["touch", "/tmp/hpa-never"],
                                                    user=bad))
            assert not os.path.exists("/tmp/hpa-never")

            c.hello.pop("users")  # as an agent of an older version greets
            with pytest.raises(GuestError, match="older than the server"):
                await c.exec(exec_meta(argv=["touch", "/tmp/hpa-never"], user="nobody"))
            with pytest.raises(GuestError, match="older than the server"):
                await c.start_process(proc_meta(argv=["touch", "/tmp/hpa-never"],
                                                user="nobody"))
            assert not os.path.exists("/tmp/hpa-never")

    asyncio.run(go())
