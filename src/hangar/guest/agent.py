"""The guest agent: runs inside every sandbox, standard library only.

It serves the framed protocol of ``hangar.guest.protocol`` over the
virtio-serial port named ``hangar.agent`` (``/dev/vportNpM``), over vsock
(Firecracker), or, for tests on a host, over a Unix socket (``--listen PATH``).

Operations (``meta["op"]`` of a REQUEST frame) are looked up in one table,
``hangar.guest.ops.OPS`` (op name → handler, one module per group of ops);
an op not in it is answered ERROR ``invalid``. The transports are
``hangar.guest.transports``; this module keeps the agent's own job: one
``Session`` per host connection (``hangar.guest.channel``), the HELLO that
opens it, and the dispatch of its frames to requests.

Failures end the channel with an ERROR frame whose ``code`` is one of
``not_found``, ``is_directory``, ``not_directory``, ``exists``,
``not_empty``, ``permission_denied``, ``invalid``, ``io_error``,
``unsupported_version``, ``internal``.

Flow control: stream bytes to the host (exec output, file reads, tunnel
bytes) go out only while the host's window for the channel has room
(``Channel.stream``, ``hangar.guest.channel``), so a slow reader on the host blocks the writer
here (an exec's pipe fills and the command waits, a terminal's program
blocks on its writes, a file watch stops reading inotify); bytes from the
host are acknowledged as they are taken (``Channel.get``). CANCEL cancels
the request's task: an exec's process group is killed, a file or socket is
closed, a terminal is hung up, a watch stops. A host connection that ends
cancels all of its requests (``Session.close``).

The agent is one-per-guest and trusts its host: the guest, not the agent,
is the security boundary. Users' commands run in cgroups under limits set below the
guest's own (``hangar.guest.limits``), so no command can starve the agent of processes,
memory or CPU, and a timeout or kill ends everything a command started. Orphaned processes are reaped by PID 1
(``hangar.guest.init``); the agent reaps its own children.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

from hangar import __version__
from hangar.guest import limits, paths, spawn, transports
from hangar.guest import protocol as P
from hangar.guest.channel import Channel, Session
from hangar.guest.identity import read_generation
from hangar.guest.ops import OPS, OpError
from hangar.guest.ops.common import BASE_ENV
from hangar.guest.procs import ProcessTable
from hangar.guest.transports import (
    PORT_NAME, VSOCK_PORT, find_port, kernel_channel, serve_port, serve_unix, serve_vsock,
)

__all__ = [  # the transports' names too, where their callers found them before the split
    "Agent", "boot_marks", "main", "warm_malloc",
    "PORT_NAME", "VSOCK_PORT", "find_port", "kernel_channel", "serve_port", "serve_unix",
    "serve_vsock",
]

BOOT_ID = os.urandom(16).hex()


def boot_marks(path: str = paths.BOOT_MARKS) -> dict[str, float]:
    """The boot's marks (``paths.BOOT_MARKS``: step → guest uptime, s); {} when there are none
    (a test host)."""
    marks: dict[str, float] = {}
    try:
        with open(path) as f:
            for line in f:
                step, _, value = line.partition(" ")
                try:
                    marks[step] = float(value)
                except ValueError:
                    continue
    except OSError:
        pass
    return marks


class Agent:
    """Serves requests; one instance per guest, surviving host reconnects."""

    def __init__(self) -> None:
        self.sessions: set[Session] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.generation = read_generation()
        self.procs = ProcessTable()
        """Processes that outlive their connection (``hangar.guest.procs``)."""

    def alone(self, ch: Channel) -> tuple[int, ...] | None:
        """The fds of the host's connections when ``ch`` is the one request open on all
        of them (``spawn.Settle``: an exec may then wait for its command's exit until
        the host sends more), else None."""
        fds = []
        for session in self.sessions:
            if any(c is not ch for c in session.channels.values()) or session.input_fd is None:
                return None
            fds.append(session.input_fd)
        return tuple(fds)

    def hello_meta(self) -> dict[str, Any]:
        """The HELLO meta: versions, window, boot id, pid, uptime (s), requests in progress,
        fork generation, the boot's marks (``boot_marks``), ``users`` (true: ``exec``
        and ``proc_start`` run a request's ``user``, ``hangar.guest.users``; an older
        agent would run it as root, so the host sends none to an agent without it) and
        ``spawn`` (how commands start: ``hangar.guest.spawn.METHOD``)."""
        try:
            with open("/proc/uptime") as f:
                uptime = float(f.read().split()[0])
        except OSError:
            uptime = None
        return {
            "agent_version": __version__,
            "protocol": P.VERSION,
            "window": P.WINDOW,
            "boot_id": BOOT_ID,
            "pid": os.getpid(),
            "uptime_s": uptime,
            "requests": len(self.tasks),
            "generation": self.generation,
            "boot": boot_marks(),
            "users": True,
            "spawn": spawn.METHOD,
        }

    async def session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve one host connection until it closes; then cancel its requests."""
        session = Session(writer)
        self.sessions.add(session)
        await session.send(P.Kind.HELLO, 0, self.hello_meta())
        channels = session.channels  # a frame for a channel not open is skipped unparsed
        decoder = P.Decoder(lambda kind, cid: kind == P.Kind.REQUEST or cid in channels)
        try:
            while True:
                data = await reader.read(1 << 16)
                if not data:
                    break
                for frame in decoder.feed(data):
                    await self.dispatch(frame, session)
        finally:
            self.sessions.discard(session)
            session.close()
            try:
                writer.transport.abort()
            except Exception:
                pass

    async def dispatch(self, frame: P.Frame, session: Session) -> None:
        """Route one frame: a REQUEST opens a channel and starts its operation's task; WINDOW,
        CANCEL and the rest go to the channel they name."""
        if frame.version != P.VERSION:
            await session.send(P.Kind.ERROR, frame.channel, {
                "code": "unsupported_version",
                "message": f"agent speaks protocol {P.VERSION}, got {frame.version}",
            })
            return
        ch = session.channels.get(frame.channel)
        if frame.kind == P.Kind.REQUEST:
            if ch is not None:
                await session.send(P.Kind.ERROR, frame.channel,
                                   {"code": "invalid", "message": "channel already open"})
                return
            ch = session.channels[frame.channel] = Channel(session, frame.channel)
            task = ch.task = asyncio.create_task(self.run_request(frame, ch))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        elif ch is None:
            return  # a channel that ended: late frames are dropped
        elif frame.kind == P.Kind.WINDOW:
            ch.outflow.grant(P.granted(frame))
        elif frame.kind == P.Kind.CANCEL:
            if ch.task is not None:
                ch.task.cancel()
        else:
            if frame.kind in P.FLOW_KINDS:
                ch.inflow.arrive(frame.size)  # the host is trusted to keep to its window
            if ch.listener is not None:
                ch.listener(frame)
            else:
                ch.inbox.put_nowait(frame)

    async def run_request(self, frame: P.Frame, ch: Channel) -> None:
        """Run the REQUEST's operation (``OPS``) and answer RESPONSE or ERROR on ``ch``."""
        op = frame.meta.get("op")
        handler = OPS.get(op) if isinstance(op, str) else None
        try:
            if handler is None:
                raise OpError("invalid", f"unknown operation: {op!r}")
            result = await handler(self, frame.meta, ch)
            data = b""
            if isinstance(result, tuple):
                result, data = result
            await ch.send(P.Kind.RESPONSE, result, data)
        except OpError as exc:
            await ch.send(P.Kind.ERROR, {"code": exc.code, "message": exc.message})
        except asyncio.CancelledError:
            pass  # the host cancelled (CANCEL) or went away: it expects nothing more
        except Exception:  # the agent must outlive any one request
            # The traceback goes to the guest's console (serial.log on the
            # host); the caller gets no exception text.
            import traceback

            traceback.print_exc(file=sys.stderr)
            await ch.send(P.Kind.ERROR, {
                "code": "internal",
                "message": f"the guest agent failed during {op!r}; its console log has details"})
        finally:
            if ch.session.channels.get(frame.channel) is ch:
                del ch.session.channels[frame.channel]
            for work in ch.afterwards:  # the answer is out: what the host need not wait for
                try:
                    work()
                except Exception:  # noqa: BLE001 -- the agent must outlive it
                    import traceback

                    traceback.print_exc(file=sys.stderr)


MALLOC_WARMUP = 1 << 20
"""Bytes allocated and freed once at start: see ``warm_malloc``."""


def warm_malloc(size: int = MALLOC_WARMUP) -> None:
    """Have glibc's malloc serve blocks up to ``size`` bytes from its heap.

    glibc maps every block above its threshold (128 KiB at first) with mmap
    and unmaps it on free, and raises the threshold only when a mapped block
    larger than it is freed. asyncio reads the agent's port 256 KiB at a time,
    so until then every read maps, faults in and unmaps fresh pages: under
    TCG that halved uploads (16 MiB written at 12 MiB/s, 24 once warmed).
    Freeing one mapped block of ``size`` raises the threshold to it.
    """
    bytearray(size)


def main(argv: list[str] | None = None) -> None:
    """Run the agent: ``--listen PATH`` serves a Unix socket, else the guest's channel."""
    args = sys.argv[1:] if argv is None else argv
    warm_malloc()
    if not args:  # in a guest (never on a test host under --listen): commands' limits
        limits.setup()
    agent = Agent()
    served = transports.serve(agent, args)

    async def coro() -> None:
        limits.Watchdog().start()  # a no-op without limits
        await served

    try:  # a command's default cwd: spawning there needs no chdir
        os.chdir(BASE_ENV["HOME"])
    except OSError:
        pass
    print(f"hangar-agent {__version__} protocol {P.VERSION} starting", file=sys.stderr, flush=True)
    asyncio.run(coro())


if __name__ == "__main__":
    main()
