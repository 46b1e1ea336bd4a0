"""The QMP client: one command to a VM's QEMU, or a session of several (``qemu.qmp``).

Every VMM serves QMP on the sandbox's ``qmp.sock`` (``SandboxPaths.qmp``).
A connection must open within ``CONNECT_S`` and each command answer within
``COMMAND_S``; any failure (QEMU's own error, a closed socket, a timeout)
becomes one ``EngineError`` that names the command and carries the
sandbox's id.

``qemu.qmp`` logs each failed connect and each lost session at level ERROR,
before raising it; here every such failure reaches the caller as that one
EngineError (a refused connect while QEMU starts is tried again and is no
error at all), so only the library's CRITICAL lines are logged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from qemu.qmp import QMPClient, QMPError

from hangar.engines.base import VM
from hangar.errors import EngineError

logging.getLogger("qemu.qmp").setLevel(logging.CRITICAL)

CONNECT_S = 5.0
"""Seconds to connect to QEMU's QMP socket."""
COMMAND_S = 30.0
"""Seconds for QEMU to answer one QMP command."""


@asynccontextmanager
async def session(vm: VM) -> AsyncIterator[QMPClient]:
    """One QMP connection for a sequence of commands (``run``); EngineError if it cannot
    connect. Disconnects on exit.

    QEMU's socket file exists from its ``bind()``; until its ``listen()`` a
    connect is refused, a gap a busy host can stretch. A refused connect is
    tried again (every 50 ms, within the same ``CONNECT_S``) while QEMU runs.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + CONNECT_S
    while True:
        client = QMPClient(f"hangar-{vm.sandbox_id}")
        try:
            await asyncio.wait_for(client.connect(str(vm.paths.qmp)),
                                   max(0.1, deadline - loop.time()))
            break
        except (TimeoutError, QMPError, OSError) as exc:
            refused = isinstance(getattr(exc, "exc", exc), ConnectionRefusedError)
            if refused and loop.time() < deadline and vm.alive():
                await asyncio.sleep(0.05)
                continue
            raise EngineError(f"QMP connect failed: {exc}", sandbox_id=vm.sandbox_id) from None
    try:
        yield client
    finally:
        await _disconnect(client)


async def run(client: QMPClient, vm: VM, command: str, **args: object) -> Any:
    """Run ``command`` with ``args`` on an open ``session``; returns QEMU's answer.
    Raises EngineError."""
    try:
        return await asyncio.wait_for(client.execute(command, args or None), COMMAND_S)
    except (TimeoutError, QMPError, OSError) as exc:
        raise EngineError(f"QMP {command} failed: {exc}", sandbox_id=vm.sandbox_id) from None


async def execute(vm: VM, command: str, **args: object) -> object:
    """Connect, run one ``command`` with ``args`` and disconnect; returns QEMU's answer.
    Raises EngineError."""
    client = QMPClient(f"hangar-{vm.sandbox_id}")
    try:
        await asyncio.wait_for(client.connect(str(vm.paths.qmp)), CONNECT_S)
        return await asyncio.wait_for(client.execute(command, args or None), COMMAND_S)
    except (TimeoutError, QMPError, OSError) as exc:
        raise EngineError(f"QMP {command} failed: {exc}", sandbox_id=vm.sandbox_id) from None
    finally:
        await _disconnect(client)


async def _disconnect(client: QMPClient) -> None:
    try:
        await client.disconnect()
    except Exception:  # noqa: BLE001 -- a QEMU that went away is disconnected already
        pass
