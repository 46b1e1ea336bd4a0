# Generated from hangar/client/_async/objects.py by scripts/gen_sync.py: do not edit.
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
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from hangar.client._sync.client import Hangar, Button, Direction, OutputHandler
from hangar.client._sync.processes import Processes
from hangar.client._sync.streams import FileWatch, Terminal
from hangar.client.execution import CodeContext, Execution
from hangar.schemas import (
    ActionResult, DisplayInfo, Event, ExecResult, ExecStreamEvent, FileEntry, KeyResult,
    MachineInfo, NetworkRules, PortInfo, SandboxInfo, Snapshot, VncTicket, WriteResult,
)


class Files:
    """Files of one sandbox (``sandbox.files``). Relative paths start at /root."""

    def __init__(self, client: Hangar, sandbox_id: str) -> None:
        self._client = client
        self._id = sandbox_id

    def read(self, path: str) -> bytes:
        """The file's bytes. Raises NotFound."""
        return self._client.read_file(self._id, path)

    def write(self, path: str, data: bytes | str, mode: int = 0o644) -> WriteResult:
        """Write ``data`` (text is UTF-8 encoded) atomically, creating parent folders."""
        raw = data.encode() if isinstance(data, str) else data
        return self._client.write_file(self._id, path, raw, mode)

    def list(self, path: str = "/root") -> builtins.list[FileEntry]:
        """A directory's entries."""
        return self._client.list_files(self._id, path)

    def stat(self, path: str) -> FileEntry:
        """One path's type, size (bytes), mode and modification time."""
        return self._client.stat_file(self._id, path)

    def make_dir(self, path: str, parents: bool = True) -> FileEntry:
        """Create a directory (and its parents)."""
        return self._client.make_dir(self._id, path, parents)

    def remove(self, path: str, recursive: bool = False) -> None:
        """Remove a file, or a directory with ``recursive``."""
        self._client.remove_file(self._id, path, recursive)

    def watch(self, path: str, recursive: bool = False) -> FileWatch:
        """Changes under ``path`` as they happen: ``async with`` it, then iterate
        ``FileEvent`` objects (see the client's ``watch_files``)."""
        return self._client.watch_files(self._id, path, recursive)


class Desktop:
    """The screen, pointer and keyboard of a desktop sandbox (``sandbox.desktop``); pixels."""

    def __init__(self, client: Hangar, sandbox_id: str) -> None:
        self._client = client
        self._id = sandbox_id

    def screenshot(self, width: int | None = None) -> bytes:
        """The screen as PNG bytes, scaled to ``width`` when given."""
        return self._client.screenshot(self._id, width)

    def click(self, x: int, y: int, button: Button = "left",
                    double: bool = False) -> ActionResult:
        return self._client.click(self._id, x, y, button, double)

    def move(self, x: int, y: int) -> ActionResult:
        return self._client.move(self._id, x, y)

    def drag(self, from_x: int, from_y: int, to_x: int, to_y: int,
                   button: Button = "left") -> ActionResult:
        return self._client.drag(self._id, from_x, from_y, to_x, to_y, button)

    def type(self, text: str) -> ActionResult:
        """Type any Unicode text exactly."""
        return self._client.type(self._id, text)

    def key(self, keys: str) -> KeyResult:
        """Press keys such as ``ctrl+shift+t`` or ``enter``."""
        return self._client.key(self._id, keys)

    def scroll(self, direction: Direction, amount: int = 3, x: int | None = None,
                     y: int | None = None) -> ActionResult:
        return self._client.scroll(self._id, direction, amount, x, y)

    def display(self) -> DisplayInfo:
        """Screen size and pointer position."""
        return self._client.display(self._id)

    def vnc_ticket(self, view_only: bool = False) -> VncTicket:
        """A single-use ticket (30 s) for the live view's WebSocket."""
        return self._client.vnc_ticket(self._id, view_only)


class Sandbox:
    """One sandbox: ``create()`` or ``connect()`` it, then run commands, move files, snapshot.

    ``info`` is the sandbox as last seen (``refresh()`` reads it again);
    ``files`` and ``desktop`` reach its files and screen, ``processes`` its
    background processes. As a context
    manager a sandbox made by ``create()`` or ``fork()`` is killed when the
    block ends; one reached by ``connect()`` is left running.
    """

    def __init__(self, client: Hangar, info: SandboxInfo, *, owns_client: bool = False,
                 kill_on_exit: bool = False) -> None:
        self.client = client
        self.info = info
        self.files = Files(client, info.id)
        self.desktop = Desktop(client, info.id)
        self.processes = Processes(client, info.id)
        self._owns_client = owns_client
        self._kill_on_exit = kill_on_exit

    @property
    def id(self) -> str:
        """The sandbox's id (``sb-`` and 12 hex digits)."""
        return self.info.id

    def __repr__(self) -> str:
        return f"<Sandbox {self.info.id} {self.info.state}>"

    @classmethod
    def create(cls, image: str | None = None, *, vcpus: int | None = None,
                     memory_mib: int | None = None, disk_mib: int | None = None,
                     timeout: float | None = None, metadata: Mapping[str, str] | None = None,
                     network: str | Mapping[str, Any] | None = None, desktop: str | None = None,
                     volumes: Mapping[str, Any] | None = None,
                     secrets: Mapping[str, str] | None = None,
                     client: Hangar | None = None, base_url: str | None = None,
                     api_key: str | None = None) -> Sandbox:
        """Create a sandbox (arguments as ``AsyncHangar.create``; ``timeout`` is its TTL, s).

        Uses ``client``, or a client of its own for ``base_url``/``api_key``.
        """
        own = client is None
        c = client or Hangar(base_url, api_key)
        try:
            info = c.create(image, vcpus=vcpus, memory_mib=memory_mib, disk_mib=disk_mib,
                                  timeout=timeout, metadata=metadata, network=network,
                                  desktop=desktop, volumes=volumes, secrets=secrets)
        except BaseException:
            if own:
                c.close()
            raise
        return cls(c, info, owns_client=own, kill_on_exit=True)

    @classmethod
    def connect(cls, sandbox_id: str, *, client: Hangar | None = None,
                      base_url: str | None = None, api_key: str | None = None) -> Sandbox:
        """An existing sandbox. Raises NotFound or Gone."""
        own = client is None
        c = client or Hangar(base_url, api_key)
        try:
            info = c.get(sandbox_id)
        except BaseException:
            if own:
                c.close()
            raise
        return cls(c, info, owns_client=own)

    def refresh(self) -> SandboxInfo:
        """Read the sandbox's state again."""
        self.info = self.client.get(self.id)
        return self.info

    def exec(self, command: str, *, args: Sequence[str] | None = None,
                   env: Mapping[str, str] | None = None, cwd: str | None = None,
                   stdin: str | bytes | None = None, timeout: float | None = None,
                   max_output: int | None = None, show_command: bool = False,
                   retry: bool = False) -> ExecResult:
        """Run a command to completion (see ``AsyncHangar.exec``)."""
        return self.client.exec(self.id, command, args=args, env=env, cwd=cwd,
                                      stdin=stdin, timeout=timeout, max_output=max_output,
                                      show_command=show_command, retry=retry)

    def exec_stream(self, command: str, *, args: Sequence[str] | None = None,
                          env: Mapping[str, str] | None = None, cwd: str | None = None,
                          stdin: str | bytes | None = None, timeout: float | None = None,
                          show_command: bool = False) -> Iterator[ExecStreamEvent]:
        """Run a command, yielding output chunks as they come, then ``exit``."""
        for ev in self.client.exec_stream(self.id, command, args=args, env=env, cwd=cwd,
                                                stdin=stdin, timeout=timeout,
                                                show_command=show_command):
            yield ev

    def snapshot(self) -> Snapshot:
        """Save memory, devices and disk; the sandbox keeps running."""
        return self.client.snapshot(self.id)

    def restore(self, snapshot_id: str) -> SandboxInfo:
        """Bring the sandbox back to one of its snapshots."""
        self.info = self.client.restore(self.id, snapshot_id)
        return self.info

    def fork(self, snapshot_id: str | None = None, *,
                   timeout: float | None = None) -> Sandbox:
        """A new sandbox started from ``snapshot_id``, or from a snapshot taken now.

        The fork shares this sandbox's client; ``timeout`` is its TTL, seconds.
        """
        snap = snapshot_id or (self.snapshot()).id
        info = self.client.fork(snap, timeout=timeout)
        return Sandbox(self.client, info, kill_on_exit=True)

    def expose(self, port: int, public: bool = False) -> str:
        """Reach the guest's TCP ``port`` over HTTP and WebSockets; returns its URL.

        A private port (the default) needs the API key (``X-API-Key``) at that
        URL; ``port(n).signed_url`` gives a link that works without it for a
        while (browsers). See ``AsyncHangar.expose``."""
        return (self.client.expose(self.id, port, public)).url

    def ports(self) -> builtins.list[PortInfo]:
        """The exposed ports with their URLs (private ones with new signed URLs)."""
        return self.client.ports(self.id)

    def port(self, port: int, *, token_ttl: float | None = None) -> PortInfo:
        """One exposed port; a private one with a signed URL valid ``token_ttl`` seconds."""
        return self.client.port(self.id, port, token_ttl=token_ttl)

    def close_port(self, port: int) -> None:
        """Stop exposing ``port``; its URLs answer 404."""
        self.client.close_port(self.id, port)

    def run_code(self, code: str, context: CodeContext | str | None = None, *,
                       language: str | None = None, envs: Mapping[str, str] | None = None,
                       timeout: float | None = None, on_stdout: OutputHandler | None = None,
                       on_stderr: OutputHandler | None = None,
                       on_result: OutputHandler | None = None,
                       on_error: OutputHandler | None = None) -> Execution:
        """Run Python in the code interpreter of a ``code-interpreter`` sandbox; variables
        persist in a context between calls. See ``AsyncHangar.run_code``."""
        return self.client.run_code(self.id, code, context=context, language=language,
                                          envs=envs, timeout=timeout, on_stdout=on_stdout,
                                          on_stderr=on_stderr, on_result=on_result,
                                          on_error=on_error)

    def create_code_context(self, cwd: str | None = None,
                                  language: str | None = None) -> CodeContext:
        """A new code context (a kernel with its own variables)."""
        return self.client.create_code_context(self.id, cwd=cwd, language=language)

    def list_code_contexts(self) -> builtins.list[CodeContext]:
        """Every code context, the default one included."""
        return self.client.list_code_contexts(self.id)

    def restart_code_context(self, context: CodeContext | str) -> None:
        """Restart a context's kernel (its variables are lost)."""
        self.client.restart_code_context(self.id, context)

    def remove_code_context(self, context: CodeContext | str) -> None:
        """Remove a context (its kernel is shut down)."""
        self.client.remove_code_context(self.id, context)

    def set_timeout(self, timeout: float) -> SandboxInfo:
        """Expire ``timeout`` seconds from now (0: never)."""
        self.info = self.client.set_timeout(self.id, timeout)
        return self.info

    def update_network(self, *, allow: Sequence[str] | None = None,
                             deny: Sequence[str] | None = None,
                             egress: str | None = None) -> NetworkRules:
        """Replace this sandbox's egress ``allow``/``deny`` lists (None keeps one) while it
        runs; see ``AsyncHangar.update_network`` and docs/networking.md."""
        return self.client.update_network(self.id, allow=allow, deny=deny, egress=egress)

    def terminal(self, command: str | None = None, *, cols: int = 80, rows: int = 24,
                       env: Mapping[str, str] | None = None, cwd: str | None = None,
                       grace: float | None = None) -> Terminal:
        """A new terminal session (a login shell, or ``command``), attached: ``send`` keys,
        ``recv`` output, ``resize``, ``wait`` for the exit code."""
        return self.client.terminal(self.id, command, cols=cols, rows=rows, env=env,
                                           cwd=cwd, grace=grace)

    def events(self, *, kinds: Sequence[str] = (),
               last_event_id: str | None = None) -> Iterator[Event]:
        """Live events of this sandbox (see ``AsyncHangar.events``)."""
        return self.client.events(kinds=kinds, sandbox_id=self.id, last_event_id=last_event_id)

    def kill(self) -> None:
        """Delete the sandbox (its VM and files); already gone is fine."""
        from hangar.errors import Gone, NotFound

        try:
            self.client.delete(self.id)
        except (NotFound, Gone):
            pass

    def close(self) -> None:
        """Close the client if this object made it (the sandbox keeps running)."""
        if self._owns_client:
            self.client.close()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._kill_on_exit:
                self.kill()
        finally:
            self.close()


class Machine:
    """A user's persistent machine: one sandbox that sleeps when idle and wakes on demand.

    ``info`` is the machine as last seen; ``files`` reach its sandbox's
    files (a call to a sleeping machine wakes it first).
    """

    def __init__(self, client: Hangar, info: MachineInfo, *,
                 owns_client: bool = False) -> None:
        self.client = client
        self.info = info
        self.files = Files(client, info.sandbox_id)
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
    def get_or_create(cls, user_id: str, *, idle_timeout: float | None = None,
                            image: str | None = None, vcpus: int | None = None,
                            memory_mib: int | None = None, disk_mib: int | None = None,
                            client: Hangar | None = None, base_url: str | None = None,
                            api_key: str | None = None) -> Machine:
        """The user's machine, created if there is none (the options apply only then)."""
        own = client is None
        c = client or Hangar(base_url, api_key)
        try:
            info = c.get_or_create_machine(user_id, idle_timeout=idle_timeout, image=image,
                                                 vcpus=vcpus, memory_mib=memory_mib,
                                                 disk_mib=disk_mib)
        except BaseException:
            if own:
                c.close()
            raise
        return cls(c, info, owns_client=own)

    def refresh(self) -> MachineInfo:
        """Read the machine's state again (no wake)."""
        self.info = self.client.get_machine(self.user_id)
        return self.info

    def exec(self, command: str, *, args: Sequence[str] | None = None,
                   env: Mapping[str, str] | None = None, cwd: str | None = None,
                   stdin: str | bytes | None = None, timeout: float | None = None,
                   max_output: int | None = None, retry: bool = False) -> ExecResult:
        """Run a command, waking the machine first if it sleeps."""
        return self.client.machine_exec(self.user_id, command, args=args, env=env,
                                              cwd=cwd, stdin=stdin, timeout=timeout,
                                              max_output=max_output, retry=retry)

    def sleep(self) -> MachineInfo:
        """Snapshot the machine and stop its VM. Raises Busy while a command runs."""
        self.info = self.client.sleep_machine(self.user_id)
        return self.info

    def wake(self) -> MachineInfo:
        """Restore the machine from its sleep snapshot."""
        self.info = self.client.wake_machine(self.user_id)
        return self.info

    def delete(self) -> None:
        """Remove the machine and everything it held."""
        self.client.delete_machine(self.user_id)

    def close(self) -> None:
        """Close the client if this object made it (the machine stays)."""
        if self._owns_client:
            self.client.close()

    def __enter__(self) -> Machine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
