"""The face's small sub-surfaces that wrap a part returning records or needing two parts.

``SandboxManager`` (``hangar.core.service``) carries each named sub-surface
as an attribute; api and cluster call ``m.<surface>.<verb>(...)`` and never
the part behind it. The parts that are already surfaces (``Ports``,
``Processes``, ``Terminals``, ``Desktop``: typed verbs, frozen results) are
used as they are; these three wrap the ones that are not:

=================  ===========================================================
``VolumesFace``    named volumes (``core.volumes.Volumes``) as ``VolumeView``
``SecretsFace``    the vault (``core.secrets.Vault``) as ``SecretView``; a
                   change reaches running sandboxes' proxies
``NetworkFace``    a running sandbox's egress rules (``core.network``), its
                   secret proxy told of each change
``FilesFace``      a sandbox's files (``core.guestcalls``): read, write, list, stat,
                   mkdir, remove, watch
``CodeFace``       the code interpreter of a ``code-interpreter`` sandbox
                   (``core.interpreter``)
=================  ===========================================================
"""

from __future__ import annotations

import builtins
import dataclasses
from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING, Any

from hangar.core import interpreter
from hangar.core.commands import HOME, FileEntry, FileEvent, FileList, WriteResult
from hangar.core.teams import unscoped
from hangar.core.views import FsckView, SecretView, VolumeView

if TYPE_CHECKING:
    from hangar.core.guestcalls import GuestCalls
    from hangar.core.sandboxes import SandboxManager
    from hangar.core.network import NetworkRules
    from hangar.core.secret_proxy import SecretProxies
    from hangar.core.secrets import Vault
    from hangar.core.volumes import Volumes


class VolumesFace:
    """Named volumes that outlive sandboxes (docs/volumes.md). Sizes MiB. A team sees and
    names its own volumes only, by the names it gave them; the operator sees every one, a
    team's as ``TEAM/name`` (``hangar.core.teams``)."""

    def __init__(self, volumes: Volumes) -> None:
        self._v = volumes

    def _view(self, rec: Any) -> VolumeView:
        return dataclasses.replace(VolumeView.of(rec, self._v.holders(rec.id)),
                                   name=unscoped(rec.name))

    def list(self) -> list[VolumeView]:
        """Every volume the acting team may see, oldest first."""
        return [self._view(r) for r in self._v.list()]

    def get(self, ref: str) -> VolumeView:
        """One volume by id or name. Raises NotFound (also for another team's)."""
        return self._view(self._v.get(ref))

    async def create(self, name: str, size_mib: int) -> VolumeView:
        """A new empty volume, the acting team's. Raises InvalidRequest (bad name or size),
        Conflict (name taken, or over the server's cap), QuotaExceeded (over the team's
        ``max_volumes_mib``)."""
        return self._view(await self._v.create(name, size_mib))

    async def resize(self, ref: str, size_mib: int) -> VolumeView:
        """Grow a volume (offline). Raises NotFound, InvalidRequest, Conflict (held, or over
        the server's cap), QuotaExceeded (over its team's ``max_volumes_mib``), Busy."""
        return self._view(await self._v.resize(ref, size_mib))

    def delete(self, ref: str) -> None:
        """Delete a volume and its data. Raises NotFound, Conflict (held), Busy."""
        self._v.delete(ref)

    async def fsck(self, ref: str) -> FsckView:
        """Check and repair a volume's filesystem (``e2fsck -f -y``). Raises NotFound,
        Conflict (held), Busy, VolumeCorrupt (beyond repair)."""
        return await self._v.fsck(ref)

    async def files(self, ref: str, path: str) -> tuple[str, Any]:
        """``("dir", (entries, total))`` or ``("file", bytes)``; see ``Volumes.files``."""
        return await self._v.files(ref, path)

    def of_sandbox(self, sandbox_id: str) -> dict[str, Any] | None:
        """``{path: {"volume": id, "read_only": bool}}`` mounted in the sandbox, or None."""
        return self._v.view(sandbox_id)


def _secret_view(rec: Any) -> SecretView:
    return dataclasses.replace(SecretView.of(rec), name=unscoped(rec.name))


class SecretsFace:
    """The vault: secrets sandboxes use through their egress proxy without holding them. A
    team sees, names and binds its own secrets only, by the names it gave them; the
    operator sees every one, a team's as ``TEAM/name`` (``hangar.core.teams``)."""

    def __init__(self, vault: Vault, proxies: SecretProxies) -> None:
        self._vault = vault
        self._proxies = proxies

    def list(self) -> list[SecretView]:
        """The name and hosts of every secret the acting team may see (never a value)."""
        return [_secret_view(r) for r in self._vault.list()]

    def get(self, name: str) -> SecretView:
        """Raises NotFound (also for another team's)."""
        return _secret_view(self._vault.get(name))

    def add(self, name: str, value: str, hosts: builtins.list[str]) -> SecretView:
        """Store a new secret, the acting team's. Raises InvalidRequest, Conflict (name
        taken)."""
        return _secret_view(self._vault.add(name, value, hosts))

    def rotate(self, name: str, value: str, hosts: builtins.list[str] | None) -> SecretView:
        """A new value (and hosts); running sandboxes' proxies use it from their next
        request. Raises NotFound, InvalidRequest."""
        got = _secret_view(self._vault.rotate(name, value, hosts))
        self._proxies.refresh()
        return got

    def delete(self, name: str) -> None:
        """Delete a secret; proxies refuse its placeholder from then on. Raises NotFound."""
        self._vault.delete(name)
        self._proxies.refresh()

    def of_sandbox(self, sandbox_id: str) -> dict[str, str] | None:
        """``{env var: secret name}`` the sandbox was given, or None (never a value)."""
        binding = self._vault.binding(sandbox_id)
        if binding is None:
            return None
        return {var: unscoped(str(b.get("secret", ""))) for var, b in binding.env.items()
                if isinstance(b, dict)}


class NetworkFace:
    """A running sandbox's egress rules."""

    def __init__(self, rules: NetworkRules, proxies: SecretProxies) -> None:
        self._rules = rules
        self._proxies = proxies

    async def change(self, sandbox_id: str, *, allow: list[str] | None = None,
                     deny: builtins.list[str] | None = None, egress: str | None = None
                     ) -> dict[str, Any]:
        """Replace the sandbox's rules (None keeps a list); returns the policy as stored.
        A sandbox with secrets has its proxy told. Raises what ``NetworkRules.change`` does:
        NotFound/Gone, Conflict, InvalidRequest, EngineError."""
        stored = await self._rules.change(sandbox_id, allow=allow, deny=deny, egress=egress)
        self._proxies.update_policy(sandbox_id, stored)
        return stored


class CodeFace:
    """The code interpreter of a ``code-interpreter`` sandbox (``hangar.core.interpreter``:
    the errors each raises)."""

    def __init__(self, manager: SandboxManager) -> None:
        self._m = manager

    async def call(self, sandbox_id: str, method: str, path: str, body: Any = None) -> Any:
        """One context call (``/contexts...``); its JSON, None for an empty answer."""
        return await interpreter.call(self._m, sandbox_id, method, path, body)

    async def execute(self, sandbox_id: str, code: str, *, context_id: str | None = None,
                      language: str | None = None, env_vars: dict[str, str] | None = None,
                      timeout: float | None = None) -> AsyncIterator[bytes]:
        """Run ``code``; the server's NDJSON lines. See ``interpreter.execute``."""
        return await interpreter.execute(self._m, sandbox_id, code, context_id=context_id,
                                         language=language, env_vars=env_vars,
                                         timeout=timeout)


class FilesFace:
    """A sandbox's files, through its guest agent; each call wakes a sleeping sandbox first
    and holds it busy while it runs. Relative paths start at ``HOME``. The errors are
    ``GuestCalls``'s: NotFound, InvalidRequest, Conflict, and those of ``GuestCalls.using``."""

    def __init__(self, calls: GuestCalls) -> None:
        self._calls = calls

    def read(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        """A file's bytes, in chunks as the guest sends them."""
        return self._calls.read_file(sandbox_id, path)

    async def write(self, sandbox_id: str, path: str,
                    chunks: Iterable[bytes] | AsyncIterator[bytes],
                    mode: int = 0o644) -> WriteResult:
        """Write a file from ``chunks`` (atomically); its path and size."""
        return await self._calls.write_file(sandbox_id, path, chunks, mode)

    async def list(self, sandbox_id: str, path: str = HOME) -> FileList:
        """A folder's absolute path and its entries, sorted by name."""
        return await self._calls.list_dir(sandbox_id, path)

    async def stat(self, sandbox_id: str, path: str) -> FileEntry:
        """One file's entry (a symlink's own)."""
        return await self._calls.stat(sandbox_id, path)

    async def mkdir(self, sandbox_id: str, path: str, parents: bool = True) -> FileEntry:
        """Make a folder (and with ``parents`` its missing parents); its entry."""
        return await self._calls.mkdir(sandbox_id, path, parents)

    async def remove(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
        """Remove a file, or a folder (empty, or with ``recursive`` all in it)."""
        await self._calls.remove(sandbox_id, path, recursive)

    def watch(self, sandbox_id: str, path: str,
              recursive: bool = False) -> AsyncIterator[builtins.list[FileEvent]]:
        """An empty batch once the watch is in place, then batches of ``FileEvent``."""
        return self._calls.watch(sandbox_id, path, recursive)
