"""Booted templates: every image's sandboxes start from one snapshot of a VM that booted it.

A template snapshot is a VM of the image, booted as a template source
(``VMSpec.template_source``: its RAM in a shared file), whose template start
command ran until its ready check passed (``hangar.core.startup``), with
E2B's default user made in it (``E2B_USER_FILE``), then
saved with ``Engine.snapshot(..., template=True)``: device state, disk and
one copy of the memory that every clone maps copy-on-write.

Where and when: ``images/<name>-<digest>/template-snapshots/<key>/``
(``ImagePaths.template_snapshot``), in the image cache every server on the
host shares, removed with the build by ``hangar image gc``. It is made
lazily, by the first create that can use it (the create waits for it), and
ahead of time when the server starts its warm pool. ``key`` is the SHA-256
of everything the snapshot depends on: the image build (its digest fixes
the rootfs and kernel), the initramfs (named by the tag of the guest
agent's Python files, which a snapshot holds running), the engine and its exact VMM version,
the machine arguments (accelerator, CPU, vCPUs, memory), the disk size,
the kernel arguments, the NIC kind, and the template's start command,
ready check, workdir and environment. When any of them changes, the key
does and a new snapshot is made; old ones stay until their build is
collected, so sandboxes and user snapshots that came from them run on
(a clone's memory is a private mapping of a sealed in-memory copy).

Making one is safe when servers race: one holds ``.<key>.lock`` (flock),
builds in ``.<key>.tmp-*`` and renames it into place; the others wait on
the lock and find it made. Before each restore the manifest is compared
with this engine (``usable``); a snapshot that does not match (another
QEMU build, a machine or image mismatch, a missing file) is removed and
made again, never restored into a broken guest.

Not used (the create boots cold): for a create that asks for a size the
image's default is not, on an engine without template snapshots, when
``HANGAR_TEMPLATE_SNAPSHOTS=0``, and after making one failed for an engine
reason (retried after ``RETRY_AFTER_S``). A template whose start command or
ready check fails fails the create: a cold boot would fail the same way.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import hashlib
import json
import logging
import os
import secrets
import shutil
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hangar import durable
from hangar.config import Settings
from hangar.core.startup import needs_start, run_template
from hangar.engines.agent_client import exec_meta
from hangar.engines.base import VM, Engine, VMSpec, again_if_stalled
from hangar.engines.snapshot_io import read_manifest
from hangar.errors import EngineError, GuestError, HangarError, NotFound, Timeout
from hangar.guest import paths
from hangar.guest.desktop import CMDLINE_KEY
from hangar.images import GuestImage
from hangar.layout import ImagePaths, Layout
from hangar.net import NetAttachment, NetworkManager

log = logging.getLogger("hangar.templates")

KEY_FORMAT = 2
"""Bumped when what a template snapshot holds changes, so old ones are not used (2: E2B's
default user, ``E2B_USER_FILE``)."""
E2B_USER_FILE = "e2b-user"
"""In a template snapshot's folder: the user E2B's envd calls of its clones default to,
made in the template VM before it was saved (``hangar.core.e2b_user.USER_SETUP``):
``user``, or ``root`` where the image has no ``setpriv``; absent when the setup failed
(a create through ``/e2b`` then runs it)."""
RETRY_AFTER_S = 300.0
"""After an engine failure making a snapshot, creates of that key boot cold this long, s."""
BUILD_PREFIX = "tpl-"
"""Sandbox-id prefix of the VMs that template snapshots are made from."""
FORGET_SECRETS = ("rm -f /etc/ssh/ssh_host_*_key /etc/ssh/ssh_host_*_key.pub; "
                  "rm -f /var/lib/systemd/random-seed; sync")
"""Run in the template VM before it is saved: per-host secrets are never in a template."""
WARM_SHELL = ("if [ -x /bin/bash ]; then /bin/bash -l -c true; fi; "
              "if command -v python3 >/dev/null; then "
              "python3 -c 'import http.server, json, subprocess, urllib.request'; fi")
"""Run in the template VM before it is saved, so that bash, its libraries and the login
scripts, and Python with the modules a sandbox's first script most often imports, are in
the saved page cache: E2B's SDK runs every command as ``/bin/bash -l -c``, and a clone's
first one otherwise reads them from its disk under emulation (about 0.1 s for bash, 0.6 s
of a first ``python3 -c 'import http.server'``'s 2.3 s, under TCG). A failure here only
logs."""


class TemplateSnapshots:
    """Finds, checks and makes images' booted snapshots. One per server."""

    def __init__(self, settings: Settings, layout: Layout, engine: Engine,
                 net: NetworkManager | None,
                 publish: Callable[..., None] | None = None) -> None:
        self.settings = settings
        self.layout = layout
        self.engine = engine
        self.net = net
        self.publish = publish or (lambda *_a, **_k: None)
        self._locks: dict[str, asyncio.Lock] = {}
        self._failed: dict[str, float] = {}  # key -> until when creates boot cold
        self._last: dict[tuple[Any, ...], Path] = {}  # (image name, shape) -> snapshot used

    @property
    def enabled(self) -> bool:
        """Whether creates restore template snapshots on this server."""
        return (bool(getattr(self.settings, "template_snapshots", True))
                and hasattr(self.engine, "snapshot") and hasattr(self.engine, "restore"))

    def spec(self, sandbox_id: str, image: GuestImage, vcpus: int, memory_mib: int,
             disk_mib: int, kernel_args: tuple[str, ...] = (),
             net: NetAttachment | None = None, template_source: bool = False) -> VMSpec:
        return VMSpec(sandbox_id, image, self.layout.sandbox(sandbox_id), vcpus, memory_mib,
                      disk_mib, hostname=sandbox_id, kernel_args=kernel_args, net=net,
                      template_source=template_source)

    def key(self, image: GuestImage, vcpus: int, memory_mib: int, disk_mib: int,
            kernel_args: tuple[str, ...] = (), nic: str | None = None) -> str:
        """Hex SHA-256 (24 digits) of every input of the snapshot (module docstring)."""
        engine = self.engine
        spec = self.spec("key", image, vcpus, memory_mib, disk_mib, kernel_args)
        machine = engine.machine_args(spec) if hasattr(engine, "machine_args") else [
            str(vcpus), str(memory_mib)]
        t = image.template or {}
        inputs = {
            "format": KEY_FORMAT, "engine": engine.name, "vmm": getattr(engine, "version", ""),
            "accel": engine.accel, "image": image.id, "machine": machine, "disk_mib": disk_mib,
            # The initramfs carries the guest agent's Python files and is named by
            # their tag, not by the image's digest: a snapshot holds a running agent,
            # so a changed agent needs a new snapshot.
            "initrd": image.initrd.name,
            "kernel_args": list(kernel_args), "nic": nic,
            "guest_args": list(engine.guest_kernel_args()),
            "start": t.get("start"), "ready": t.get("ready"), "workdir": t.get("workdir"),
            "env": t.get("env"),
        }
        raw = json.dumps(inputs, sort_keys=True, default=str).encode()
        return hashlib.sha256(raw).hexdigest()[:24]

    def usable(self, path: Path, image: GuestImage, spec: VMSpec) -> str | None:
        """None when the snapshot in ``path`` can be restored for ``spec``, else why not."""
        engine = self.engine
        try:
            m = read_manifest(path, engine.name)
        except NotFound:
            return "missing"
        except EngineError as exc:
            return exc.message
        if m.image_digest != image.digest:
            return f"made for image digest {m.image_digest}"
        if getattr(engine, "version", m.vmm_version) != m.vmm_version:
            return f"made by {engine.name} {m.vmm_version}"
        if hasattr(engine, "machine_args") and engine.machine_args(spec) != m.machine:
            return "made on another machine shape"
        return None

    async def ensure(self, image: GuestImage, vcpus: int, memory_mib: int, disk_mib: int,
                     kernel_args: tuple[str, ...] = (), nic: str | None = None) -> Path | None:
        """The folder of the image's template snapshot for this shape, made if missing or
        unusable; None when creates of it boot cold (engine failure, see ``RETRY_AFTER_S``).

        Raises GuestError (the start command failed) or Timeout (the ready check did
        not pass): the template itself is broken, and a cold boot would be too.
        """
        key = self.key(image, vcpus, memory_mib, disk_mib, kernel_args, nic)
        if self._failed.get(key, 0.0) > time.time():
            return None
        files = ImagePaths(image.dir)
        dest = files.template_snapshot(key)
        probe = self.spec("probe", image, vcpus, memory_mib, disk_mib, kernel_args)
        if self.usable(dest, image, probe) is None:
            self._note(image, (vcpus, memory_mib, disk_mib, kernel_args, nic), dest)
            return dest
        async with self._locks.setdefault(key, asyncio.Lock()):
            try:
                files.template_snapshots.mkdir(exist_ok=True)
                # readable by all: it holds only the id of the VM a build boots, which a
                # split server (another user than a root build's) reads (``building``)
                # never through a link (a server's folder holds it, under the split):
                # a symlink is ELOOP, a second name of another file refused. Root never
                # runs this beside a split server (``hangar.cli.snapshot_step``).
                lock_fd = os.open(files.template_snapshot_lock(key),
                                  os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
                st = os.fstat(lock_fd)
                if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                    os.close(lock_fd)
                    raise OSError(errno.ELOOP, f"{files.template_snapshot_lock(key)} is not "
                                               "a lock file of its own")
            except OSError as exc:
                log.warning("template snapshots unavailable", extra={
                    "image": image.id, "error": str(exc)})
                self._failed[key] = time.time() + RETRY_AFTER_S
                return None
            try:
                await asyncio.to_thread(fcntl.flock, lock_fd, fcntl.LOCK_EX)
                why = self.usable(dest, image, probe)
                if why is None:
                    return dest  # another server (or task) made it meanwhile
                if why != "missing":
                    log.warning("template snapshot unusable: made again", extra={
                        "image": image.id, "key": key, "reason": why})
                    self.engine.release_snapshot(dest)
                    shutil.rmtree(dest, ignore_errors=True)
                try:
                    await again_if_stalled(
                        lambda: self._make(image, key, dest, vcpus, memory_mib, disk_mib,
                                           kernel_args, nic, lock_fd), {"image": image.id})
                except (GuestError, Timeout):
                    raise
                except (HangarError, OSError) as exc:
                    log.warning("template snapshot failed: creates boot cold", extra={
                        "image": image.id, "key": key,
                        "error": exc.message if isinstance(exc, HangarError) else str(exc)})
                    self._failed[key] = time.time() + RETRY_AFTER_S
                    return None
                self._note(image, (vcpus, memory_mib, disk_mib, kernel_args, nic), dest)
                return dest
            finally:
                os.close(lock_fd)  # releases the flock

    def _note(self, image: GuestImage, shape: tuple[Any, ...], dest: Path) -> None:
        """Remember the snapshot this image and shape now restore; when it replaces another
        (a rebuilt image, a new QEMU), release the old one's in-memory copy: running clones
        keep their own mapping of it, and no new clone will come from it."""
        before = self._last.get((image.name, shape))
        self._last[(image.name, shape)] = dest
        if before is not None and before != dest:
            self.engine.release_snapshot(before)

    async def _make(self, image: GuestImage, key: str, dest: Path, vcpus: int,
                    memory_mib: int, disk_mib: int, kernel_args: tuple[str, ...],
                    nic: str | None, lock_fd: int) -> None:
        """Boot, start, check, forget per-host secrets, save into ``dest`` (atomically).
        The template VM's id is written into the lock file held (``lock_fd``), so that a
        server starting meanwhile on the same data directory spares it (``building``)."""
        engine = self.engine
        sid = f"{BUILD_PREFIX}{secrets.token_hex(6)}"
        os.ftruncate(lock_fd, 0)
        os.pwrite(lock_fd, sid.encode(), 0)
        stage = dest.parent / f".{key}.tmp-{sid}"
        t0 = time.monotonic()
        net: NetAttachment | None = None
        vm: VM | None = None
        agent = None
        try:
            if nic is not None and self.net is not None:
                net = await self.net.attach_async(sid, {"egress": "none"} if nic == "none"
                                                  else _policy_for(nic))
            vm = await engine.boot(self.spec(sid, image, vcpus, memory_mib, disk_mib,
                                             kernel_args, net, template_source=True))
            agent = await engine.connect_agent(vm, self.settings.boot_deadline_s(engine.accel),
                                               cold=True)
            if needs_start(image.template):
                await run_template(agent, image.template or {}, name=image.name,
                                   sandbox_id=sid)
            if any(a.startswith(CMDLINE_KEY + "=") for a in kernel_args):
                await _desktop_up(agent, self.settings.boot_deadline_s(engine.accel), sid)
            try:
                await agent.exec(exec_meta(argv=["/bin/sh", "-c", WARM_SHELL], timeout=30))
            except HangarError as exc:
                log.warning("template warm-up failed", extra={"image": image.id,
                                                               "error": str(exc)})
            e2b_user = await _e2b_user(agent, image)
            await agent.exec(exec_meta(argv=["/bin/sh", "-c", FORGET_SECRETS], timeout=30))
            await engine.snapshot(vm, stage, template=True)
            if e2b_user is not None:
                durable.atomic_write(stage / E2B_USER_FILE, e2b_user.encode(), 0o644)
            os.rename(stage, dest)
            durable.fsync_dir(dest.parent)
        finally:
            if agent is not None:
                await agent.close()
            if vm is not None:
                await engine.stop(vm)
            shutil.rmtree(self.layout.sandbox(sid).dir, ignore_errors=True)
            shutil.rmtree(stage, ignore_errors=True)
            if net is not None and self.net is not None:
                try:
                    await self.net.release_async(sid)
                except Exception as exc:  # never let clean-up hide the build's outcome
                    log.warning("network release failed", extra={"sandbox_id": sid,
                                                                   "error": str(exc)})
        took = round(time.monotonic() - t0, 3)
        log.info("template snapshot made", extra={"image": image.id, "key": key,
                                                   "duration_s": took})
        self.publish("template.snapshot", None, image=image.name, key=key, duration_s=took)


def building(layout: Layout) -> set[str]:
    """Ids of the template VMs (``tpl-...``) that a live build holds now, in this process
    or another (``hangar image build`` beside a server): each build writes its VM's id into
    the lock file of the snapshot it makes while it holds that file's flock. A lock file
    this process cannot open, or whose lock is free, names no live build."""
    ids: set[str] = set()
    for lock in layout.images.glob("*/template-snapshots/.*.lock"):
        try:
            fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                sid = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
                if sid.startswith(BUILD_PREFIX):
                    ids.add(sid)
            else:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
    return ids


DESKTOP_UP = (f'while ! grep -q \'"vnc": true\' {paths.DESKTOP_READY} 2>/dev/null; do '
              f'if [ -e {paths.DESKTOP_ERROR} ]; then cat {paths.DESKTOP_ERROR} >&2; exit 1; fi; '
              'sleep 0.2; done')
"""Waits in the guest until its desktop's X answers and x11vnc listens (the supervisor's
ready file says ``"vnc": true``, ``hangar.guest.desktop``); exits 1 with the reason when the
desktop cannot run."""


async def _e2b_user(agent: Any, image: GuestImage) -> str | None:
    """Make E2B's default user in a template VM (``hangar.core.e2b_user.USER_SETUP``, as
    root), so that a create through ``/e2b`` from the template needs no exec for it; the
    user its clones' envd calls default to (``E2B_USER_FILE``), or None when the setup
    failed (logged; such a create runs it)."""
    from hangar.core.e2b_user import DEFAULT_USER, ROOT, SETUP_TIMEOUT_S, USER_SETUP

    try:
        r = await agent.exec(exec_meta(argv=["/bin/sh", "-c", USER_SETUP],
                                       timeout=SETUP_TIMEOUT_S))
    except HangarError as exc:
        log.warning("E2B's default user not made in the template", extra={
            "image": image.id, "error": exc.message})
        return None
    if r.exit_code in (0, 3):  # 3: no setpriv, envd runs as root
        return DEFAULT_USER if r.exit_code == 0 else ROOT
    log.warning("E2B's default user not made in the template", extra={
        "image": image.id, "error": r.stderr.head.decode(errors="replace")[-300:]})
    return None


def e2b_user(folder: Path) -> str | None:
    """The user a template snapshot in ``folder`` made for E2B (``E2B_USER_FILE``): ``user``
    or ``root``; None when it made none (or the file is unreadable)."""
    try:
        text = (folder / E2B_USER_FILE).read_text().strip()
    except OSError:
        return None
    return text if text in ("user", "root") else None


async def _desktop_up(agent: Any, deadline_s: float, sid: str) -> None:
    """Wait until a template VM's desktop is up (``DESKTOP_UP``), so that its snapshot holds
    a running X, window manager and VNC server rather than ones still starting. Raises
    GuestError (the desktop cannot run) or Timeout (not up within ``deadline_s``)."""
    r = await agent.exec(exec_meta(argv=["/bin/sh", "-c", DESKTOP_UP], timeout=deadline_s))
    if r.timed_out:
        raise Timeout(f"the template VM's desktop was not up within {deadline_s:.0f} s",
                      sandbox_id=sid)
    if r.exit_code != 0:
        raise GuestError("the template VM's desktop cannot run: "
                         + r.stderr.head.decode("utf-8", "replace").strip()[:300], sandbox_id=sid)


def _policy_for(nic: str) -> dict[str, Any]:
    """The egress policy a template VM's NIC is attached with (``nic``: a policy's JSON, and
    for a user-mode NIC its kind, ``nic``, which is the key's, not the policy's)."""
    try:
        policy = json.loads(nic)
    except ValueError:
        return {"egress": "internet"}
    if not isinstance(policy, dict):
        return {"egress": "internet"}
    return {k: v for k, v in policy.items() if k != "nic"}


def nic_of(network: dict[str, Any] | None, mode: str = "tap") -> str | None:
    """The NIC part of a template snapshot's key for a sandbox's stored policy (None: no NIC)
    on a server whose NICs are of ``mode`` (``NetworkManager.mode``).

    The policy itself is applied on the host (filters on the TAP device), so
    sandboxes with any policy share one snapshot: the key says there is a NIC, and for
    QEMU's user-mode NIC which kind (its device state is not a TAP NIC's: a TAP server's
    snapshot restored with it ended QEMU mid-migration, a 500 for every create).
    """
    if not network:
        return None
    return json.dumps({"egress": "internet"} if mode == "tap"
                      else {"egress": "open", "nic": mode})  # user mode filters nothing


def make_for_build(layout: Layout, image: GuestImage, engine: Engine, settings: Settings,
                   say: Callable[[str], None]) -> Path | None:
    """Make ``image``'s template snapshot now, for a build command (``hangar image build``,
    ``hangar template build``), with the server's ``engine`` and ``settings`` (so in the
    shape its server uses: default sizes and disk; a NIC when its sandboxes get one,
    ``HANGAR_NETWORK=tap`` or ``auto`` where TAP works); for an image with a desktop
    (``admission.has_desktop``) also the variant with a ``DEFAULT_SCREEN`` desktop. Returns
    the folder of the first, or None when this engine makes none (the server then boots
    cold). Blocks; boots a VM (two for a desktop image).

    Raises GuestError or Timeout when the template's start command or ready check fails.
    """
    import asyncio as _asyncio

    from hangar.core.admission import DEFAULT_SCREEN, default_size, has_desktop
    from hangar.core.launch import desktop_args, network_manager

    if not settings.template_snapshots:
        return None
    # A NIC where the server's sandboxes get one: HANGAR_NETWORK=tap, or "auto" on a host
    # where TAP networking works (the mode a server started here picks). Otherwise the
    # server would make that variant itself on its first create, which under emulation
    # takes minutes (longer than a client such as E2B's SDK waits for a create).
    net = (network_manager(settings, getattr(engine, "helper", None))
           if settings.network in ("tap", "auto") else None)
    if net is not None and net.mode != "tap":
        net = None
    vcpus, memory = default_size(image, settings)
    nic = nic_of({"egress": "internet"}, net.mode) if net is not None else None
    t = TemplateSnapshots(settings, layout, engine, net)
    say(f"{image.id}: booting it for its template snapshot")
    made = _asyncio.run(t.ensure(image, vcpus, memory, settings.default_disk_mib, (), nic))
    say(f"{image.id}: template snapshot {made}" if made else
        f"{image.id}: no template snapshot made (this engine makes none, or making it "
        "failed: see the warning above)")
    if made and has_desktop(image):
        # and with the desktop most creates ask for: the first would else boot it cold and
        # make this snapshot itself, minutes under emulation
        say(f"{image.id}: booting it with a {DEFAULT_SCREEN} desktop for its template "
            "snapshot")
        shown = _asyncio.run(t.ensure(image, vcpus, memory, settings.default_disk_mib,
                                      desktop_args(DEFAULT_SCREEN), nic))
        say(f"{image.id}: template snapshot with a desktop {shown}")
    return made
