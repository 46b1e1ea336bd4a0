"""Snapshots over QEMU's migration stream: saving and loading a VM's state, the VM's shape.

``save_state`` pauses the VM and migrates it into a file which the server
opens, passing QEMU a file descriptor (QMP ``getfd``, then
``migrate fd:migration``): a confined QEMU may neither open the snapshot
folder nor spawn ``cat`` (QEMU 7.2 has no ``file:`` transport). All-zero
pages cost a few bytes, so the stream is about the guest memory in use.
``load_state`` feeds that file to a QEMU started with ``-incoming defer``
(``migrate-incoming fd:migration``). Both wait for ``query-migrate`` to
report completion, for at most ``timeout_for(memory_mib)`` seconds.

A stream with RAM is stored compressed (``compression`` ``zstd``, the
manifest's ``state_compression``): QEMU's descriptor is then one end of a
pipe, and a ``zstd`` process the server starts holds the other end and the
file (``hangar.engines.qemu.streampipe``): about 3.5 x less disk for a
sleeping machine, at about 0.35 s of one core per 100 MiB on save and 0.1 s
on load. The same timeout covers zstd's last writes. When the migration
fails and zstd failed too (a file that is not a whole zstd stream, a full
disk), the error is zstd's; zstd is ended and reaped pass or fail. A
stream stored as QEMU wrote it (``none``: a template's, or a snapshot of
manifest format 1) is passed as the file itself.

With ``ignore_shared`` (a template: ``hangar.engines.qemu.template``), both
sides turn on QEMU's ``x-ignore-shared`` capability: the source leaves out
RAM it maps shared (its ``memory-backend-file,share=on``), so the stream
holds the device state only, and the destination, whose RAM is a private
mapping of that memory's copy, expects no RAM pages (the flag changes the
stream's header, so both sides must have it). QEMU 7.2 has it (as an
experimental ``x-`` capability, which Kata Containers' VM templating uses).

The guest TSC and clocks are part of the saved CPU state and simply
continue, so the guest's wall clock lags by the time the snapshot sat on
disk until ``snapshot_io.refresh_guest`` sets it. The files of a snapshot
and its manifest are ``hangar.engines.snapshot_io``'s; ``shape_of`` reads
what a manifest records of a running VM from its command line.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from qemu.qmp import QMPClient, QMPError

from hangar.engines import process
from hangar.engines.base import VM
from hangar.engines.snapshot_io import COMPRESSIONS, NONE
from hangar.engines.qemu import qmp, streampipe
from hangar.engines.qemu.argv import MACHINE_FLAGS, without_tuning
from hangar.errors import EngineError, Timeout
from hangar.layout import ImagePaths

MIGRATE_BANDWIDTH = 1 << 40  # bytes/s: no limit in practice (QEMU's default is 128 MiB/s)
MIGRATE_TIMEOUT_S = 60.0
MIGRATE_S_PER_GIB = 60.0  # extra seconds of migration timeout per GiB of guest memory
IGNORE_SHARED = "x-ignore-shared"
"""The migration capability that leaves shared RAM out of the stream."""
MIGRATION_FD = "migration"
"""The name under which a snapshot's stream is passed to QEMU (QMP ``getfd``)."""


def timeout_for(memory_mib: float) -> float:
    """Seconds a migration of a guest with ``memory_mib`` MiB may take."""
    return MIGRATE_TIMEOUT_S + memory_mib / 1024 * MIGRATE_S_PER_GIB


async def wait_migration(client: QMPClient, vm: VM, timeout: float) -> dict[str, Any]:
    """Poll ``query-migrate`` until it completes; returns its last answer.

    Raises ``EngineError`` when the migration fails or QEMU dies, and
    ``Timeout`` after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    delay = 0.01
    while True:
        if not vm.alive():
            tail = process.tail(vm.paths.vmm_log, 1) or "no output"
            raise EngineError(f"QEMU exited during the migration: {tail}",
                              sandbox_id=vm.sandbox_id)
        info = await qmp.run(client, vm, "query-migrate")
        status = info.get("status", "none")
        if status == "completed":
            done: dict[str, Any] = info
            return done
        if status in ("failed", "cancelled", "cancelling"):
            reason = info.get("error-desc", "no reason given")
            raise EngineError(f"migration {status}: {reason}", sandbox_id=vm.sandbox_id)
        if time.monotonic() > deadline:
            raise Timeout(f"migration did not complete in {timeout:.0f} s (status {status})",
                          sandbox_id=vm.sandbox_id)
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.2)


async def pass_fd(client: QMPClient, vm: VM, fd: int) -> None:
    """Hand the open descriptor ``fd`` to QEMU as ``MIGRATION_FD`` (QMP ``getfd``; QEMU
    gets its own copy, the caller still closes ``fd``). Raises EngineError.

    A confined QEMU can neither open the snapshot folder nor spawn a
    helper, so the migration stream reaches it as an open file or pipe.
    """
    try:
        client.send_fd_scm(fd)
        await qmp.run(client, vm, "getfd", fdname=MIGRATION_FD)
    except (QMPError, OSError) as exc:
        raise EngineError(f"cannot pass the migration stream to QEMU: {exc}",
                          sandbox_id=vm.sandbox_id) from None


async def pass_file(client: QMPClient, vm: VM, path: Path, flags: int) -> None:
    """Open ``path`` here (``os.open`` ``flags``, mode 0600) and ``pass_fd`` it. Raises
    EngineError."""
    try:
        fd = os.open(path, flags | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise EngineError(f"cannot open {path.name}: {exc.strerror}",
                          sandbox_id=vm.sandbox_id) from None
    try:
        await pass_fd(client, vm, fd)
    finally:
        os.close(fd)


async def set_ignore_shared(client: QMPClient, vm: VM, on: bool) -> None:
    """Turn the ``x-ignore-shared`` capability on or off; raises EngineError."""
    await qmp.run(client, vm, "migrate-set-capabilities",
                  capabilities=[{"capability": IGNORE_SHARED, "state": on}])


async def save_state(vm: VM, path: Path, memory_mib: float, *, ignore_shared: bool = False,
                     compression: str = NONE) -> dict[str, Any]:
    """Pause ``vm`` (QMP ``stop``) and migrate its device state and RAM into ``path``
    (created or truncated), compressed with ``compression`` (``snapshot_io.NONE`` or ``ZSTD``:
    see the module docstring); returns ``query-migrate``'s last answer.

    ``ignore_shared``: leave out the RAM that QEMU maps shared (see the
    module docstring); the capability is turned off again afterwards, so a
    later snapshot of the same VM holds its RAM. The VM ends paused (QEMU's
    ``postmigrate`` state). On failure the migration is cancelled, so the VM
    is left paused and usable. The whole save, zstd's last writes included,
    takes at most ``timeout_for(memory_mib)`` seconds. Raises ``EngineError``
    (zstd's own message when it failed: no zstd, a full disk) or ``Timeout``.
    """
    timeout = timeout_for(memory_mib)
    deadline = time.monotonic() + timeout
    async with qmp.session(vm) as client:
        await qmp.run(client, vm, "stop")
        await qmp.run(client, vm, "migrate-set-parameters",
                      **{"max-bandwidth": MIGRATE_BANDWIDTH})
        # Set either way: a template's clone came in with it on (``load_state``), and a
        # stream saved with it on (it carries each RAM block's address) is read only by
        # a QEMU that has it on too, so a user snapshot of a clone would not restore.
        await set_ignore_shared(client, vm, ignore_shared)
        try:
            if compression == NONE:
                await pass_file(client, vm, path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                return await _migrate_out(client, vm, timeout)
            check_compression(compression, vm.sandbox_id)
            async with streampipe.compressing(path, vm.sandbox_id) as pipe:
                await pass_fd(client, vm, pipe.qemu_end)
                pipe.handed_over()
                info = await pipe.alongside(_migrate_out(client, vm, timeout))
                await pipe.finish(deadline - time.monotonic())
                return info
        finally:
            if ignore_shared:
                try:
                    await asyncio.shield(set_ignore_shared(client, vm, False))
                except (EngineError, asyncio.CancelledError):
                    pass


async def _migrate_out(client: QMPClient, vm: VM, timeout: float) -> dict[str, Any]:
    """``migrate`` into the passed ``MIGRATION_FD`` and wait for it; cancels it on failure."""
    await qmp.run(client, vm, "migrate", uri=f"fd:{MIGRATION_FD}")
    try:
        return await wait_migration(client, vm, timeout)
    except BaseException:
        try:  # leave the VM paused and usable, not mid-migration
            await asyncio.shield(qmp.run(client, vm, "migrate_cancel"))
        except (EngineError, asyncio.CancelledError):
            pass
        raise


async def load_state(client: QMPClient, vm: VM, path: Path, memory_mib: float, *,
                     ignore_shared: bool = False, compression: str = NONE) -> None:
    """Load the state saved in ``path`` into ``vm``, a QEMU started with ``-incoming defer``,
    over the open QMP ``client``; the VM stays paused. ``ignore_shared``: the
    stream was saved with it (a template's), so its RAM is not in it.
    ``compression``: how the file is stored (the manifest's ``state_compression``).
    Takes at most ``timeout_for(memory_mib)`` seconds. Raises ``EngineError`` (zstd's
    own message when the file is not a whole zstd stream) or ``Timeout``."""
    if ignore_shared:
        await set_ignore_shared(client, vm, True)
    timeout = timeout_for(memory_mib)
    if compression == NONE:
        await pass_file(client, vm, path, os.O_RDONLY)
        await qmp.run(client, vm, "migrate-incoming", uri=f"fd:{MIGRATION_FD}")
        await wait_migration(client, vm, timeout)
        return
    check_compression(compression, vm.sandbox_id)
    async with streampipe.decompressing(path, vm.sandbox_id) as pipe:
        await pass_fd(client, vm, pipe.qemu_end)
        pipe.handed_over()
        await qmp.run(client, vm, "migrate-incoming", uri=f"fd:{MIGRATION_FD}")
        await pipe.alongside(wait_migration(client, vm, timeout))
        # Done: QEMU stops reading at the stream's end marker, before the VM description
        # QEMU writes after it, so zstd may still be writing that; leaving ends it.


def check_compression(compression: str, sandbox_id: str = "") -> None:
    """Raise EngineError unless ``compression`` is one this Hangar reads and writes."""
    if compression not in COMPRESSIONS:
        raise EngineError(f"the migration stream's compression {compression!r} is not one of "
                          f"{', '.join(COMPRESSIONS)}", sandbox_id=sandbox_id)


def argv_of(vm: VM) -> list[str]:
    """The running VM's QEMU argv (``/proc/<pid>/cmdline``); EngineError once it is gone."""
    argv = process.argv_of(vm.pid)
    if argv is None:
        raise EngineError("the VM's QEMU process is gone", sandbox_id=vm.sandbox_id)
    return argv


def arg(argv: list[str], flag: str) -> str:
    """The value after ``flag`` in ``argv``; EngineError when there is none."""
    try:
        return argv[argv.index(flag) + 1]
    except (ValueError, IndexError):
        raise EngineError(f"QEMU's command line has no {flag}") from None


def shape_of(vm: VM) -> tuple[list[str], dict[str, Any]]:
    """The running VM's machine arguments (without tuning) and its image's manifest,
    from its argv. Raises EngineError.

    Read from ``/proc/<pid>/cmdline`` so that VMs adopted from an earlier
    server process (whose ``VMSpec`` is gone) work too.
    """
    argv = argv_of(vm)
    machine: list[str] = []
    for flag in MACHINE_FLAGS:
        machine += [flag, arg(argv, flag)]
    machine = without_tuning(machine)
    image_paths = ImagePaths(Path(arg(argv, "-kernel")).parent)
    try:
        image: dict[str, Any] = json.loads(image_paths.manifest.read_text())
    except (OSError, ValueError) as exc:
        raise EngineError(f"cannot read the VM's image manifest: {exc}",
                          sandbox_id=vm.sandbox_id) from None
    return machine, image
