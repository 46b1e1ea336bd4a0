"""Processes that outlive their connection: typed operations by sandbox id.

A process started here runs in the background in the sandbox's guest and
outlives the call, its client and the server's connection to the agent
(the guest's table, ``hangar.guest.procs``): it is listed, attached to by
pid or tag, fed stdin, signalled, resized (a terminal) and removed. A
program that an exec leaves running (``server &``) appears too, as an
entry of origin ``exec`` whose output the guest keeps reading, so it never
writes to a closed pipe.

=====================  =============================================================
operation              what it gives
=====================  =============================================================
``start``              the new entry (``ProcessInfo``, ``hangar.schemas``)
``start_attached``     its output from its first byte (``ProcessOutput`` items,
                       then ``end``), the stream open as long as the caller reads
``list``               every entry, oldest first (at most 64)
``attach``             output from now on (``replay``: the ring's 1 MiB first) until
                       the process ends (``follow``: until its output ends)
``send_input``         bytes written to its stdin or terminal, in order
``close_stdin``        the entry, its stdin closed
``signal``             whether any of its group was left to get the signal, and the
                       entry
``resize``             the entry, its terminal resized
``kill``               its last entry; its group got SIGKILL and it is forgotten
=====================  =============================================================

Every operation raises the errors of ``GuestCalls.using`` (NotFound, Gone,
Conflict, Busy, Timeout for the sandbox), and NotFound for a pid or tag the
table lacks; see each for the rest. An attached stream (``start_attached``,
``attach``) does not hold the sandbox busy, unlike a terminal or a file watch:
a background process's output may never end (a server), and E2B's SDK keeps
such a stream open for every background command, yet a pause must still
work. A snapshot only pauses the stream; a sleep (E2B's pause) ends it with
the VM, the process lives on in the snapshot, and it is attached again by
pid after the wake. Leaving a stream detaches; the process runs on.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from hangar.core.secrets import with_env
from hangar.core.commands import Command
from hangar.core.guestcalls import GuestCalls
from hangar.engines.agent_client import ProcessStream, ProcInfo, ProcSignalled, proc_meta
from hangar.engines.agent_client.processes import PROCS_EVERY
from hangar.core.lifecycle import State
from hangar.errors import Conflict, GuestError, InvalidRequest
from hangar.schemas import ProcessInfo
from hangar.turns import mapped

__all__ = ["ProcSignalled", "ProcessInfo", "ProcessOutput", "Processes", "info_of"]


def info_of(p: ProcInfo) -> ProcessInfo:
    """The wire entry of the guest's ``ProcInfo``."""
    return ProcessInfo(
        pid=p.pid, tag=p.tag, command=p.cmd, args=p.args, env=p.env, cwd=p.cwd,
        truncated=p.truncated, origin="exec" if p.origin == "exec" else "start",
        pty=p.pty, cols=p.cols, rows=p.rows, state="running" if p.running else "exited",
        exit_code=p.exit_code, signal=p.signal, timed_out=p.timed_out,
        started_at=p.started_at, ended_at=p.ended_at, output_open=p.output_open,
        output_bytes=p.output_bytes, output_dropped=p.output_dropped,
        stdin_open=p.stdin_open)


@dataclass(frozen=True)
class ProcessOutput:
    """One event of an attached process after its entry.

    ``kind`` ``stdout``, ``stderr`` or ``pty``: ``data`` as written (``replay``:
    from the ring, written before the attach; ``dropped``: bytes this client lost
    just before it, having read too slowly). ``end``: the process ended;
    ``process`` is its final entry and ``dropped`` what this client lost in all.
    """

    kind: str
    data: bytes = b""
    replay: bool = False
    dropped: int = 0
    process: ProcessInfo | None = None


def _start_meta(cmd: Command, tag: str | None, stdin: bool, pty: tuple[int, int] | None,
                timeout: float | None) -> dict:
    if cmd.command is None:
        raise InvalidRequest("a command is needed")
    return proc_meta(cmd.command, argv=cmd.argv, env=cmd.env or None, cwd=cmd.cwd, tag=tag,
                     stdin=stdin, pty=pty, timeout=timeout, user=cmd.user)


class Processes:
    """Background processes in sandboxes' guests (see the module docstring)."""

    def __init__(self, calls: GuestCalls) -> None:
        self.calls = calls

    async def start(self, sandbox_id: str, cmd: Command, *, tag: str | None = None,
                    stdin: bool = False, pty: tuple[int, int] | None = None,
                    timeout: float | None = None) -> ProcessInfo:
        """Start ``cmd`` in the background; its entry.

        ``cmd.command`` is shell text, or the program of ``cmd.argv``;
        ``cmd.timeout_s`` is not used (``timeout``: seconds until its group is
        killed; None: it runs until it ends). ``tag`` names it (unique among
        running processes); ``stdin`` gives it a pipe for ``send_input``;
        ``pty`` (cols, rows) puts it on a terminal. Raises InvalidRequest (bad
        input, a program that cannot start), Conflict (the tag is taken),
        LimitExceeded (64 processes run in the guest).
        """
        cmd = with_env(cmd, self.calls.launcher.vault.env(sandbox_id))
        meta = _start_meta(cmd, tag, stdin, pty, timeout)
        async with self.calls.using(sandbox_id) as agent:
            return info_of(await agent.start_process(meta))

    async def start_attached(self, sandbox_id: str, cmd: Command, *, tag: str | None = None,
                             stdin: bool = False, pty: tuple[int, int] | None = None,
                             timeout: float | None = None,
                             ) -> AsyncGenerator[ProcessInfo | ProcessOutput, None]:
        """``start``, then its output: first its entry (``ProcessInfo``), then
        ``ProcessOutput`` items from its first byte to its ``end`` (whose ``process``
        is the final entry). Closing the iterator detaches; the process runs on. A stream that
        breaks midway (the guest went away) raises its error from the iterator."""
        cmd = with_env(cmd, self.calls.launcher.vault.env(sandbox_id))
        meta = _start_meta(cmd, tag, stdin, pty, timeout)
        async with self.calls.using(sandbox_id, busy=False) as agent:  # see the module
            stream = await agent.start_process_attached(meta)
            async for item in self._paused_says_so(sandbox_id, _events(stream)):
                yield item

    async def list(self, sandbox_id: str) -> list[ProcessInfo]:
        """Every entry of the guest's table, oldest first (converted ``PROCS_EVERY`` at a
        time, with turns of the loop between)."""
        async with self.calls.using(sandbox_id) as agent:
            return await mapped(info_of, await agent.list_processes(), PROCS_EVERY)

    async def attach(self, sandbox_id: str, pid: int | None = None, tag: str | None = None,
                     *, replay: bool = False,
                     follow: bool = False) -> AsyncGenerator[ProcessInfo | ProcessOutput, None]:
        """Attach to a process by ``pid`` (else ``tag``): first its entry
        (``ProcessInfo``), then ``ProcessOutput`` items, output from now on (``replay``: what
        its 1 MiB ring holds first, marked ``replay``), until ``end`` (``follow``: until
        its output ends, which a program it left running may hold open). Closing the
        iterator detaches. Raises NotFound before the first item."""
        async with self.calls.using(sandbox_id, busy=False) as agent:  # see the module
            stream = await agent.attach_process(pid, tag, replay=replay, follow=follow)
            async for item in self._paused_says_so(sandbox_id, _events(stream)):
                yield item

    async def _paused_says_so(self, sandbox_id: str, items: AsyncGenerator[
            ProcessInfo | ProcessOutput, None]) -> AsyncGenerator[ProcessInfo | ProcessOutput,
                                                                  None]:
        """``items``, but a stream that a pause (a sleep) ended raises Conflict saying so,
        rather than the agent connection's own error."""
        try:
            async for item in items:
                yield item
        except GuestError:
            rec = self.calls.ctx.store.get(sandbox_id)  # None once gone: its own error stands
            if rec is not None and rec.state in (State.SNAPSHOTTING, State.SLEEPING):
                raise Conflict(f"sandbox {sandbox_id} was paused: its processes sleep with "
                               "it; attach again by pid once it is resumed",
                               sandbox_id=sandbox_id, state=rec.state.value) from None
            raise
        finally:
            await items.aclose()

    async def send_input(self, sandbox_id: str, data: bytes, pid: int | None = None,
                         tag: str | None = None) -> int:
        """Write ``data`` to a process's stdin (or terminal), in order with other writes;
        bytes written. Raises Conflict (its input is closed), Busy (it read none of it
        for 5 s: retry)."""
        async with self.calls.using(sandbox_id) as agent:
            return await agent.send_process_input(data, pid, tag)

    async def close_stdin(self, sandbox_id: str, pid: int | None = None,
                          tag: str | None = None) -> ProcessInfo:
        """Close a process's stdin (it reads EOF). Raises InvalidRequest for a terminal
        (send Ctrl-D, byte 4, instead)."""
        async with self.calls.using(sandbox_id) as agent:
            return info_of(await agent.close_process_stdin(pid, tag))

    async def signal(self, sandbox_id: str, sig: int, pid: int | None = None,
                     tag: str | None = None) -> ProcSignalled:
        """Send signal ``sig`` (1..64) to a process's group: whether any of it was left to
        get it, and the process's status just after. Raises InvalidRequest."""
        if not 0 < sig < 65:
            raise InvalidRequest("signal must be from 1 to 64", signal=sig)
        async with self.calls.using(sandbox_id) as agent:
            return await agent.signal_process(sig, pid, tag)

    async def resize(self, sandbox_id: str, cols: int, rows: int, pid: int | None = None,
                     tag: str | None = None) -> ProcessInfo:
        """Resize a terminal process (characters, 1..1000). Raises InvalidRequest (not on
        a terminal)."""
        async with self.calls.using(sandbox_id) as agent:
            return info_of(await agent.resize_process(cols, rows, pid, tag))

    async def kill(self, sandbox_id: str, pid: int | None = None,
                   tag: str | None = None) -> ProcessInfo:
        """SIGKILL a process's group (while it runs or holds its output open), wait for
        its exit (at most 5 s) and forget it; its last entry."""
        async with self.calls.using(sandbox_id) as agent:
            return info_of(await agent.remove_process(pid, tag))


async def _events(stream: ProcessStream) -> AsyncGenerator[ProcessInfo | ProcessOutput, None]:
    """The stream's entry, then its events to the end; its error raised; detached at the
    end."""
    try:
        yield info_of(stream.info)
        while (ev := await stream.next()) is not None:
            yield ProcessOutput(ev.kind, ev.data, ev.replay, ev.dropped,
                                info_of(ev.info) if ev.info is not None else None)
        if stream.error is not None:
            raise stream.error
    finally:
        await stream.close()
