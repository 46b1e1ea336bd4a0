"""The one place ``hangar.tools`` talks to a Hangar server: an adapter over the SDK.

Everything the tools need from the server goes through ``Backend``, which
wraps ``hangar.client.AsyncHangar`` (its public methods and typed results)
and returns small values shaped for the tools.

Errors are the ``hangar.errors`` classes the SDK raises.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from hangar.client import AsyncHangar, ExecResult, Execution
from hangar.errors import Conflict, NotFound


@dataclass(frozen=True)
class SandboxInfo:
    """A sandbox a task holds. Memory in MiB."""

    id: str
    image: str
    vcpus: int
    memory_mib: int
    source: str
    """``pool`` (a warm-pool VM was taken) or ``cold`` (one was booted)."""
    desktop: str | None = None


@dataclass(frozen=True)
class ExecOutcome:
    """A finished command. ``stdout``/``stderr`` are the kept heads (bytes)."""

    exit_code: int | None
    signal: int | None
    timed_out: bool
    stdout: bytes
    stderr: bytes
    stdout_tail: bytes
    stdout_total: int
    """Bytes the command wrote to stdout (kept or not)."""
    stderr_total: int
    truncated: bool
    duration_s: float


def _stream(r: ExecResult, name: str) -> tuple[bytes, bytes]:
    """(head, tail) bytes of one stream of an exec result."""
    head: str = getattr(r, name)
    tail: str = getattr(r, f"{name}_tail")
    b64: str | None = getattr(r, f"{name}_b64")
    if b64 is not None:  # exact bytes of head + tail when not UTF-8
        raw = base64.b64decode(b64)
        n = len(head.encode())
        return raw[:n], raw[n:]
    return head.encode(), tail.encode()


class Backend:
    """A Hangar server as the tools use it. ``url``/``api_key`` as for the SDK
    (default: ``HANGAR_URL``, ``HANGAR_API_KEY`` or the key file)."""

    def __init__(self, url: str | None = None, api_key: str | None = None) -> None:
        self._client = AsyncHangar(url, api_key)
        self.url = self._client.base_url

    @property
    def ws_url(self) -> str:
        """The server's base URL with a WebSocket scheme."""
        return "ws" + self.url[4:] if self.url.startswith("http") else self.url

    def auth_headers(self) -> dict[str, str]:
        """Headers that authenticate a request (for WebSockets opened elsewhere)."""
        return {"X-API-Key": self._client.config.api_key}

    async def close(self) -> None:
        await self._client.close()

    async def create(self, image: str, *, vcpus: int | None = None,
                     memory_mib: int | None = None, timeout_s: float | None = None,
                     metadata: dict[str, str] | None = None, desktop: str | None = None,
                     network: Any = None, volumes: dict[str, Any] | None = None,
                     secrets: dict[str, str] | None = None) -> SandboxInfo:
        """A new sandbox (from the warm pool when one fits). Sizes None: the image's defaults.
        ``network``, ``volumes`` and ``secrets`` as ``POST /sandboxes`` takes them."""
        r = await self._client.create(image, vcpus=vcpus, memory_mib=memory_mib,
                                      timeout=timeout_s, metadata=metadata or None,
                                      desktop=desktop, network=network, volumes=volumes or None,
                                      secrets=secrets or None)
        return SandboxInfo(r.id, r.image, r.vcpus, r.memory_mib, r.source or "cold", r.desktop)

    async def delete(self, sandbox_id: str) -> bool:
        """Delete a sandbox; False when it was already gone."""
        try:
            await self._client.delete(sandbox_id)
        except NotFound:
            return False
        return True

    async def exists(self, sandbox_id: str) -> bool:
        try:
            r = await self._client.get(sandbox_id)
        except NotFound:
            return False
        return r.state not in ("deleted", "expired")

    async def exec(self, sandbox_id: str, command: str, *, args: list[str] | None = None,
                   cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout_s: float | None = None) -> ExecOutcome:
        r = await self._client.exec(sandbox_id, command, args=args, cwd=cwd, env=env,
                                    timeout=timeout_s)
        out, out_tail = _stream(r, "stdout")
        err, _ = _stream(r, "stderr")
        return ExecOutcome(
            exit_code=r.exit_code, signal=r.signal, timed_out=r.timed_out, stdout=out,
            stderr=err, stdout_tail=out_tail, stdout_total=r.stdout_bytes,
            stderr_total=r.stderr_bytes, truncated=r.stdout_truncated or r.stderr_truncated,
            duration_s=r.duration_s)

    async def write_file(self, sandbox_id: str, path: str, data: bytes) -> int:
        """Write ``data`` to ``path`` (parents made); returns bytes written."""
        r = await self._client.write_file(sandbox_id, path, data)
        return r.size

    async def mkdir(self, sandbox_id: str, path: str) -> None:
        """Make a folder and its parents (an agent file operation: no process runs)."""
        try:
            await self._client.make_dir(sandbox_id, path, parents=True)
        except Conflict:  # it exists
            pass

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        return await self._client.read_file(sandbox_id, path)

    async def run_code(self, sandbox_id: str, code: str, *,
                       timeout_s: float | None = None) -> Execution:
        """Run a cell in the sandbox's code interpreter (its default context). Raises
        ``NoInterpreter`` (409) for a sandbox of an image without one."""
        return await self._client.run_code(sandbox_id, code, timeout=timeout_s)

    async def screenshot(self, sandbox_id: str) -> bytes:
        """The sandbox's screen as PNG bytes."""
        return await self._client.screenshot(sandbox_id)

    async def post_event(self, kind: str, sandbox_id: str | None, data: dict[str, Any]) -> None:
        """``POST /events`` ``{"kind", "sandbox_id", "data"}``. Raises NotFound (404) or
        another ``hangar.errors`` class when the server refuses it."""
        await self._client.publish_event(kind, sandbox_id, **data)
