"""The object surface: a ``Sandbox`` or a user's ``Machine`` as one object.

In the style users know from E2B and Daytona::

    async with await AsyncSandbox.create() as sb:      # killed when the block ends
        r = await sb.exec("python3 -c 'print(6*7)'")
        await sb.files.write("/root/x.txt", b"hi")

Each object holds a flat client (``AsyncHangar``): the one passed as
``client=``, or its own made from ``base_url``/``api_key`` (closed with
the object). Source of ``hangar/client/_sync/objects.py`` (``Sandbox``,
``Machine``).
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from hangar.client._async.client import AsyncHangar, Button, Direction, OutputHandler
from hangar.client._async.processes import AsyncProcesses
from hangar.client._async.streams import AsyncFileWatch, AsyncTerminal
from hangar.client.execution import CodeContext, Execution
from hangar.schemas import (
    ActionResult, DisplayInfo, Event, ExecResult, ExecStreamEvent, FileEntry, KeyResult,
    MachineInfo, NetworkRules, PortInfo, SandboxInfo, Snapshot, VncTicket, WriteResult,
)


class AsyncFiles:
    """Files of one sandbox (``sandbox.files``). Relative paths start at /root."""

    def __init__(self, client: AsyncHangar, sandbox_id: str) -> None:
        self._client = client
        self._id = sandbox_id

    async def read(self, path: str) -> bytes:
        """The file's bytes. Raises NotFound."""
        return await self._client.read_file(self._id, path)

    async def write(self, path: str, data: bytes | str, mode: int = 0o644) -> WriteResult:
        """Write ``data`` (text is UTF-8 encoded) atomically, creating parent folders."""
        raw = data.encode() if isinstance(data, str) else data
        return await self._client.write_file(self._id, path, raw, mode)

    async def list(self, path: str = "/root") -> builtins.list[FileEntry]:
        """A directory's entries."""
        return await self._client.list_files(self._id, path)

    async def stat(self, path: str) -> FileEntry:
        """One path's type, size (bytes), mode and modification time."""
        return await self._client.stat_file(self._id, path)

    async def make_dir(self, path: str, parents: bool = True) -> FileEntry:
        """Create a directory (and its parents)."""
        return await self._client.make_dir(self._id, path, parents)

    async def remove(self, path: str, recursive: bool = False) -> None:
        """Remove a file, or a directory with ``recursive``."""
        await self._client.remove_file(self._id, path, recursive)

    def watch(self, path: str, recursive: bool = False) -> AsyncFileWatch:
        """Changes under ``path`` as they happen: ``async with`` it, then iterate
        ``FileEvent`` objects (see the client's ``watch_files``)."""
        return self._client.watch_files(self._id, path, recursive)


class AsyncDesktop:
    """The screen, pointer and keyboard of a desktop sandbox (``sandbox.desktop``); pixels."""

    def __init__(self, client: AsyncHangar, sandbox_id: str) -> None:
        self._client = client
        self._id = sandbox_id

    async def screenshot(self, width: int | None = None) -> bytes:
        """The screen as PNG bytes, scaled to ``width`` when given."""
        return await self._client.screenshot(self._id, width)

    async def click(self, x: int, y: int, button: Button = "left",
                    double: bool = False) -> ActionResult:
        return await self._client.click(self._id, x, y, button, double)

    async def move(self, x: int, y: int) -> ActionResult:
        return await self._client.move(self._id, x, y)

    async def drag(self, from_x: int, from_y: int, to_x: int, to_y: int,
                   button: Button = "left") -> ActionResult:
        return await self._client.drag(self._id, from_x, from_y, to_x, to_y, button)

    async def type(self, text: str) -> ActionResult:
        """Type any Unicode text exactly."""
        return await self._client.type(self._id, text)

    async def key(self, keys: str) -> KeyResult:
        """Press keys such as ``ctrl+shift+t`` or ``enter``."""
        return await self._client.key(self._id, keys)

    async def scroll(self, direction: Direction, amount: int = 3, x: int | None = None,
                     y: int | None = None) -> ActionResult:
        return await self._client.scroll(self._id, direction, amount, x, y)

    async def display(self) -> DisplayInfo:
        """Screen size and pointer position."""
        return await self._client.display(self._id)

    async def vnc_ticket(self, view_only: bool = False) -> VncTicket:
        """A single-use ticket (30 s) for the live view's WebSocket."""
        return await self._client.vnc_ticket(self._id, view_only)


class AsyncSandbox:
    """One sandbox: ``create()`` or ``connect()`` it, then run commands, move files, snapshot.

    ``info`` is the sandbox as last seen (``refresh()`` reads it again);
    ``files`` and ``desktop`` reach its files and screen, ``processes`` its
    background processes. As a context
    manager a sandbox made by ``create()`` or ``fork()`` is killed when the
    block ends; one reached by ``connect()`` is left running.
    """

    def __init__(self, client: AsyncHangar, info: SandboxInfo, *, owns_client: bool = False,
                 kill_on_exit: bool = False) -> None:
        self.client = client
        self.info = info
        self.files = AsyncFiles(client, info.id)
        self.desktop = AsyncDesktop(client, info.id)
        self.processes = AsyncProcesses(client, info.id)
        self._owns_client = owns_client
        self._kill_on_exit = kill_on_exit

    @property
    def id(self) -> str:
        """The sandbox's id (``sb-`` and 12 hex digits)."""
        return self.info.id

    def __repr__(self) -> str:
        return f"<Sandbox {self.info.id} {self.info.state}>"

    @classmethod
    async def create(cls, image: str | None = None, *, vcpus: int | None = None,
                     memory_mib: int | None = None, disk_mib: int | None = None,
                     timeout: float | None = None, metadata: Mapping[str, str] | None = None,
                     network: str | Mapping[str, Any] | None = None, desktop: str | None = None,
                     volumes: Mapping[str, Any] | None = None,
                     secrets: Mapping[str, str] | None = None,
                     client: AsyncHangar | None = None, base_url: str | None = None,
                     api_key: str | None = None) -> AsyncSandbox:
        """Create a sandbox (arguments as ``AsyncHangar.create``; ``timeout`` is its TTL, s).

        Uses ``client``, or a client of its own for ``base_url``/``api_key``.
        """
        own = client is None
        c = client or AsyncHangar(base_url, api_key)
        try:
            info = await c.create(image, vcpus=vcpus, memory_mib=memory_mib, disk_mib=disk_mib,
                                  timeout=timeout, metadata=metadata, network=network,
                                  desktop=desktop, volumes=volumes, secrets=secrets)
        except BaseException:
            if own:
                await c.close()
            raise
        return cls(c, info, owns_client=own, kill_on_exit=True)

    @classmethod
    async def connect(cls, sandbox_id: str, *, client: AsyncHangar | None = None,
                      base_url: str | None = None, api_key: str | None = None) -> AsyncSandbox:
        """An existing sandbox. Raises NotFound or Gone."""
        own = client is None
        c = client or AsyncHangar(base_url, api_key)
        try:
            info = await c.get(sandbox_id)
        except BaseException:
            if own:
                await c.close()
            raise
        return cls(c, info, owns_client=own)

    async def refresh(self) -> SandboxInfo:
        """Read the sandbox's state again."""
        self.info = await self.client.get(self.id)
        return self.info

    async def exec(self, command: str, *, args: Sequence[str] | None = None,
                   env: Mapping[str, str] | None = None, cwd: str | None = None,
                   stdin: str | bytes | None = None, timeout: float | None = None,
                   max_output: int | None = None, show_command: bool = False,
                   retry: bool = False) -> ExecResult:
        """Run a command to completion (see ``AsyncHangar.exec``)."""
        return await self.client.exec(self.id, command, args=args, env=env, cwd=cwd,
                                      stdin=stdin, timeout=timeout, max_output=max_output,
                                      show_command=show_command, retry=retry)

    async def exec_stream(self, command: str, *, args: Sequence[str] | None = None,
                          env: Mapping[str, str] | None = None, cwd: str | None = None,
                          stdin: str | bytes | None = None, timeout: float | None = None,
                          show_command: bool = False) -> AsyncIterator[ExecStreamEvent]:
        """Run a command, yielding output chunks as they come, then ``exit``."""
        async for ev in self.client.exec_stream(self.id, command, args=args, env=env, cwd=cwd,
                                                stdin=stdin, timeout=timeout,
                                                show_command=show_command):
            yield ev

    async def snapshot(self) -> Snapshot:
        """Save memory, devices and disk; the sandbox keeps running."""
        return await self.client.snapshot(self.id)

    async def restore(self, snapshot_id: str) -> SandboxInfo:
        """Bring the sandbox back to one of its snapshots."""
        self.info = await self.client.restore(self.id, snapshot_id)
        return self.info

    async def fork(self, snapshot_id: str | None = None, *,
                   timeout: float | None = None) -> AsyncSandbox:
        """A new sandbox started from ``snapshot_id``, or from a snapshot taken now.

        The fork shares this sandbox's client; ``timeout`` is its TTL, seconds.
        """
        snap = snapshot_id or (await self.snapshot()).id
        info = await self.client.fork(snap, timeout=timeout)
        return AsyncSandbox(self.client, info, kill_on_exit=True)

    async def expose(self, port: int, public: bool = False) -> str:
        """Reach the guest's TCP ``port`` over HTTP and WebSockets; returns its URL.

        A private port (the default) needs the API key (``X-API-Key``) at that
        URL; ``port(n).signed_url`` gives a link that works without it for a
        while (browsers). See ``AsyncHangar.expose``."""
        return (await self.client.expose(self.id, port, public)).url

    async def ports(self) -> builtins.list[PortInfo]:
        """The exposed ports with their URLs (private ones with new signed URLs)."""
        return await self.client.ports(self.id)

    async def port(self, port: int, *, token_ttl: float | None = None) -> PortInfo:
        """One exposed port; a private one with a signed URL valid ``token_ttl`` seconds."""
        return await self.client.port(self.id, port, token_ttl=token_ttl)

    async def close_port(self, port: int) -> None:
        """Stop exposing ``port``; its URLs answer 404."""
        await self.client.close_port(self.id, port)

    async def run_code(self, code: str, context: CodeContext | str | None = None, *,
                       language: str | None = None, envs: Mapping[str, str] | None = None,
                       timeout: float | None = None, on_stdout: OutputHandler | None = None,
                       on_stderr: OutputHandler | None = None,
                       on_result: OutputHandler | None = None,
                       on_error: OutputHandler | None = None) -> Execution:
        """Run Python in the code interpreter of a ``code-interpreter`` sandbox; variables
        persist in a context between calls. See ``AsyncHangar.run_code``."""
        return await self.client.run_code(self.id, code, context=context, language=language,
                                          envs=envs, timeout=timeout, on_stdout=on_stdout,
                                          on_stderr=on_stderr, on_result=on_result,
                                          on_error=on_error)

    async def create_code_context(self, cwd: str | None = None,
                                  language: str | None = None) -> CodeContext:
        """A new code context (a kernel with its own variables)."""
        return await self.client.create_code_context(self.id, cwd=cwd, language=language)

    async def list_code_contexts(self) -> builtins.list[CodeContext]:
        """Every code context, the default one included."""
        return await self.client.list_code_contexts(self.id)

    async def restart_code_context(self, context: CodeContext | str) -> None:
        """Restart a context's kernel (its variables are lost)."""
        await self.client.restart_code_context(self.id, context)

    async def remove_code_context(self, context: CodeContext | str) -> None:
        """Remove a context (its kernel is shut down)."""
        await self.client.remove_code_context(self.id, context)

    async def set_timeout(self, timeout: float) -> SandboxInfo:
        """Expire ``timeout`` seconds from now (0: never)."""
        self.info = await self.client.set_timeout(self.id, timeout)
        return self.info

    async def update_network(self, *, allow: Sequence[str] | None = None,
                             deny: Sequence[str] | None = None,
                             egress: str | None = None) -> NetworkRules:
        """Replace this sandbox's egress ``allow``/``deny`` lists (None keeps one) while it
        runs; see ``AsyncHangar.update_network`` and docs/networking.md."""
        return await self.client.update_network(self.id, allow=allow, deny=deny, egress=egress)

    async def terminal(self, command: str | None = None, *, cols: int = 80, rows: int = 24,
                       env: Mapping[str, str] | None = None, cwd: str | None = None,
                       grace: float | None = None) -> AsyncTerminal:
        """A new terminal session (a login shell, or ``command``), attached: ``send`` keys,
        ``recv`` output, ``resize``, ``wait`` for the exit code."""
        return await self.client.terminal(self.id, command, cols=cols, rows=rows, env=env,
                                           cwd=cwd, grace=grace)

    def events(self, *, kinds: Sequence[str] = (),
               last_event_id: str | None = None) -> AsyncIterator[Event]:
        """Live events of this sandbox (see ``AsyncHangar.events``)."""
        return self.client.events(kinds=kinds, sandbox_id=self.id, last_event_id=last_event_id)

    async def kill(self) -> None:
        """Delete the sandbox (its VM and files); already gone is fine."""
        from hangar.errors import Gone, NotFound

        try:
            await self.client.delete(self.id)
        except (NotFound, Gone):
            pass

    async def close(self) -> None:
        """Close the client if this object made it (the sandbox keeps running)."""
        if self._owns_client:
            await self.client.close()

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            if self._kill_on_exit:
                await self.kill()
        finally:
            await self.close()


class AsyncMachine:
    """A user's persistent machine: one sandbox that sleeps when idle and wakes on demand.

    ``info`` is the machine as last seen; ``files`` reach its sandbox's
    files (a call to a sleeping machine wakes it first).
    """

    def __init__(self, client: AsyncHangar, info: MachineInfo, *,
                 owns_client: bool = False) -> None:
        self.client = client
        self.info = info
        self.files = AsyncFiles(client, info.sandbox_id)
        self._owns_client = owns_client

    @property
    def user_id(self) -> str:
        return self.info.user_id

    @property
    def sandbox_id(self) -> str:
        return self.info.sandbox_id

    def __repr__(self) -> str:
        return f"<Machine {self.info.user_id} {self.info.state}>"

    @classmethod
    async def get_or_create(cls, user_id: str, *, idle_timeout: float | None = None,
                            image: str | None = None, vcpus: int | None = None,
                            memory_mib: int | None = None, disk_mib: int | None = None,
                            client: AsyncHangar | None = None, base_url: str | None = None,
                            api_key: str | None = None) -> AsyncMachine:
        """The user's machine, created if there is none (the options apply only then)."""
        own = client is None
        c = client or AsyncHangar(base_url, api_key)
        try:
            info = await c.get_or_create_machine(user_id, idle_timeout=idle_timeout, image=image,
                                                 vcpus=vcpus, memory_mib=memory_mib,
                                                 disk_mib=disk_mib)
        except BaseException:
            if own:
                await c.close()
            raise
        return cls(c, info, owns_client=own)

    async def refresh(self) -> MachineInfo:
        """Read the machine's state again (no wake)."""
        self.info = await self.client.get_machine(self.user_id)
        return self.info

    async def exec(self, command: str, *, args: Sequence[str] | None = None,
                   env: Mapping[str, str] | None = None, cwd: str | None = None,
                   stdin: str | bytes | None = None, timeout: float | None = None,
                   max_output: int | None = None, retry: bool = False) -> ExecResult:
        """Run a command, waking the machine first if it sleeps."""
        return await self.client.machine_exec(self.user_id, command, args=args, env=env,
                                              cwd=cwd, stdin=stdin, timeout=timeout,
                                              max_output=max_output, retry=retry)

    async def sleep(self) -> MachineInfo:
        """Snapshot the machine and stop its VM. Raises Busy while a command runs."""
        self.info = await self.client.sleep_machine(self.user_id)
        return self.info

    async def wake(self) -> MachineInfo:
        """Restore the machine from its sleep snapshot."""
        self.info = await self.client.wake_machine(self.user_id)
        return self.info

    async def delete(self) -> None:
        """Remove the machine and everything it held."""
        await self.client.delete_machine(self.user_id)

    async def close(self) -> None:
        """Close the client if this object made it (the machine stays)."""
        if self._owns_client:
            await self.client.close()

    async def __aenter__(self) -> AsyncMachine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
