"""Building templates (``hangar.images.template_file``) into immutable image builds.

A template's build is an image build like a recipe's (see
``hangar.images.builder``): ``images/<name>-<digest>/`` with rootfs.ext4,
the kernel, the initramfs and manifest.json, the digest covering its bytes,
``images/<name>`` pointing at the current one, the same lock, reuse and
``hangar image gc``. Steps:

1. The tree. From a base: the base's current build (a recipe is built
   first if it is not, which reuses its cache) is mounted read-only
   (``mount -o loop,ro,noload``: nothing is written to it, not even a
   journal replay) and copied with ``cp -a``; its kernel and modules are
   copied too. From an OCI archive: ``hangar.images.oci`` checks every layer
   (``hangar.images.oci_check``: no devices, no paths or links out of the
   tree) and unpacks it, Hangar's guest runtime is added
   (``hangar.images.runtime``: the image needs no Python), and the kernel
   is Debian's cloud kernel, as for recipes.
2. Guest set-up (host name, resolv.conf, poweroff commands, /root).
3. ``packages``: ``apt-get update`` and ``install`` in the build namespace
   (``hangar.images.confined``) with the host's network, after a copy of the
   host's apt lists (``<data>/cache/apt-lists``, under ``<data>/cache/.apt.lock``);
   nothing a build writes reaches the host's caches.
4. ``files``, copied in order, then ``env`` into ``/etc/hangar/env.json``
   (which the guest agent merges into every command's environment; an OCI
   image's own ``Env`` comes first, a base template's env is kept).
5. ``steps``: ``/bin/sh -c`` in the build namespace (``hangar.images.confined``:
   root there is an unprivileged host uid, the tree is the whole root, a
   private /proc and a minimal /dev, no network unless the template says
   ``network = true``), in ``workdir``, with an environment of the
   template's own only (nothing of the host's leaks in). Nothing of an
   image runs as host root.
6. Packing, hashing, initramfs, manifest (``builder.finish_build``); the
   manifest's ``template`` holds what sandboxes need at create: the start
   command, the ready check, default vCPUs and memory, whether it has a
   desktop.
7. ``hangar template build`` then makes the booted template snapshot
   (``hangar.core.templates``): the build is booted, its start command run
   until the ready check passes, and the VM saved; every create restores
   it. A server makes it itself on the first create when it is missing.

Without ``force`` a build whose template digest (every field of the file,
the files' contents, and the base build's id or the archive's SHA-256) is
unchanged is reused at once. Every host-side operation on the tree goes
through ``hangar.images.safetree``, so an image's symlinks cannot send one
onto the host.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from hangar.errors import ImageError, NotFound
from hangar.guest import paths
from hangar.images import confined, oci, runtime, safetree, staging, vmlinux
from hangar.images import kernel as kernels
from hangar.images.builder import build_image, finish_build
from hangar.images.catalogue import (
    current_build, image_lock, newest_build, point_symlink, read_manifest,
    recipe_digest_of, resolve_image,
)
from hangar.images.commands import Progress, require_tools, run
from hangar.images.debian import AptCaches, flock
from hangar.images.guest_image import GuestImage
from hangar.images.recipes import BASE, RECIPES
from hangar.images.staging import BuildRoom, image_at
from hangar.images.rootfs import RESOLV_PLACEHOLDER, guest_setup, put_file, python_version, trim
from hangar.images.template_file import Template, TemplateFile
from hangar.layout import ImagePaths, Layout
from hangar.privileged import beneath

ENV_FILE = paths.TEMPLATE_ENV
"""Environment of a template's sandboxes in the guest (read by ``hangar.guest.ops.common``)."""
STEP_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def build_template(layout: Layout, t: Template, *, force: bool = False,
                   progress: Progress | None = None) -> GuestImage:
    """Build ``t`` (or reuse its build) and make it the current build of its name.

    Raises NotFound (a base template that is not built), InvalidRequest (an
    archive that is not an image), ImageError (a step failed, with its
    output's tail).
    """
    say = progress or (lambda _msg: None)
    layout.ensure()
    base: GuestImage | None = None
    if t.base is not None:
        if t.base in RECIPES:
            base = build_image(layout, t.base, progress=say)  # reuses a current build
        else:
            try:
                base = resolve_image(layout, t.base)
            except NotFound:
                raise NotFound(f"template {t.name}: its base {t.base!r} is not built; build "
                               "that template first", image=t.base) from None
        base_id = base.id
    else:
        assert t.oci is not None
        base_id = f"oci-sha256:{oci.archive_digest(t.oci)}"
    digest = t.digest(base_id)
    if not force:
        d = current_build(layout, t.name)
        if d is not None and recipe_digest_of(read_manifest(d)) == digest:
            say(f"{t.name}: unchanged, build {d.name} reused")
            return image_at(layout, d.name)
    require_tools("mkfs.ext4", "depmod", "cp", "mount", "umount")
    if t.steps or t.packages:
        confined.check_available()
    with image_lock(layout, t.name):
        d = None if force else newest_build(layout, t.name, digest)
        if d is None:
            d = _build(layout, t, digest, base, say)
        point_symlink(layout, t.name, d)
        return image_at(layout, d.name)


def _build(layout: Layout, t: Template, digest: str, base: GuestImage | None,
           say: Progress) -> Path:
    t0 = time.monotonic()
    times: dict[str, float] = {}
    with BuildRoom(layout, t.name, f"{t.name}-{digest}-") as room:
        work, stage = room.work, room.stage
        paths = ImagePaths(stage)
        env: dict[str, str] = {}
        inherited: dict[str, Any] = {}
        if base is not None:
            rootdir = work / "root"
            base_manifest = read_manifest(base.dir)
            say(f"{t.name} (template {digest}): copying the tree of {base.id}")
            _copy_base(layout, base, rootdir, work, stage)
            kernel = base_manifest["kernel"]
            kernel["vmlinux"] = vmlinux.write_vmlinux(paths)
            env = _read_env(rootdir)
            inherited = dict(base.template or {})
            packages = list(base_manifest.get("recipe", {}).get("packages", [])) + list(
                t.packages)
            recipe = RECIPES.get(base.name)
            desktop = bool(inherited.get("desktop")) or (
                recipe is not None and "xvfb" in recipe.packages)
            sizes = (inherited.get("vcpus") or (recipe.default_vcpus if recipe else None),
                     inherited.get("memory_mib") or (recipe.default_memory_mib if recipe
                                                     else None))
            debian = True
        else:
            assert t.oci is not None
            image = oci.unpack(t.oci, work, say)
            rootdir = image.rootfs
            env = dict(image.env)
            inherited = {"workdir": image.workdir if image.workdir != "/" else None}
            runtime.install_runtime(rootdir, say)
            k = kernels.fetch(BASE.kernel_package, room.cached(layout.debs_cache), work,
                              stage, say)
            kernel = {"meta_package": BASE.kernel_package, "package": k.package,
                      "deb_version": k.deb_version, "version": k.version,
                      "vmlinux": vmlinux.write_vmlinux(paths)}
            packages = list(t.packages)
            desktop, sizes, debian = False, (None, None), False
            base_manifest = {"oci": {"source": str(t.oci), "command": image.command,
                                     "env": image.env, "workdir": image.workdir}}
        times["base"] = time.monotonic() - t0

        t1 = time.monotonic()
        guest_setup(rootdir)
        if t.packages:
            with confined.shifted(rootdir, say):
                _apt_in_tree(rootdir, t.packages, layout, room, say)
        times["packages"] = time.monotonic() - t1

        t1 = time.monotonic()
        for f in t.files:
            say(f"copying {f.src if f.src is not None else 'text'} to {f.dest}")
            _copy_in(rootdir, f)
        env.update(t.env)
        if env:
            put_file(rootdir, ENV_FILE, json.dumps(env, indent=2, sort_keys=True) + "\n", 0o644)
        workdir = t.workdir or inherited.get("workdir")
        if workdir:
            safetree.make_dirs(rootdir, workdir)
        if t.steps:
            with confined.shifted(rootdir, say):
                _run_steps(rootdir, t.steps, env, workdir, t.network, say)
        if debian:
            trim(rootdir)
        times["files_and_steps"] = time.monotonic() - t1

        runtime_python = safetree.readlink(rootdir, f"{runtime.RUNTIME_DIR}/bin/python3")
        pyver = (runtime_python.rsplit("/", 1)[-1].removeprefix("python")
                 if runtime_python else python_version(rootdir))
        own = t.runtime()
        # The start command and its ready check go together: a template that names
        # either has its own pair, else it keeps its base template's.
        pair = own if own["start"] is not None or own["ready"] is not None else inherited
        template = {
            "start": pair.get("start"), "ready": pair.get("ready"), "workdir": workdir,
            "env": env, "vcpus": own["vcpus"] or sizes[0],
            "memory_mib": own["memory_mib"] or sizes[1], "desktop": desktop,
            "base": t.base, "oci": str(t.oci) if t.oci else None,
            "source": str(t.source) if t.source else None,
        }
        manifest = {
            "recipe_digest": digest,
            "recipe": {"name": t.name, "description": t.description, "packages": packages},
            "template": template,
            "base": base.id if base is not None else None,
            **({"oci": base_manifest["oci"]} if base is None else {}),
            "python_version": pyver,
            "kernel": kernel,
        }
        return finish_build(layout, t.name, room, rootdir, manifest, say, times, t0)


def _copy_base(layout: Layout, base: GuestImage, rootdir: Path, work: Path,
               stage: Path) -> None:
    """The base build's tree into ``rootdir`` and its kernel into ``stage``. The base's
    folder and files are opened without following a link (a split server owns
    ``images`` and its folders): its rootfs is put on a loop device by descriptor and
    mounted read-only, its kernel and modules copied from descriptors."""
    mnt = work / "base-rootfs"
    mnt.mkdir()
    rootdir.mkdir()
    owners = (0, os.geteuid())  # an image's files are root's (or the unprivileged builder's)
    dest = ImagePaths(stage)
    with staging.opened_build(layout, base.id) as bfd:
        with beneath.walked(bfd, ImagePaths(Path()).rootfs.name) as rfd:
            beneath.expect(rfd, uids=owners)
            with staging.loop_device(rfd) as dev:
                run("mount base", ["mount", "-o", "ro,noload", dev, mnt], timeout=120)
                try:
                    run("copy base", ["cp", "-a", f"{mnt}/.", f"{rootdir}/"], timeout=1800)
                finally:
                    try:
                        run("umount base", ["umount", mnt], timeout=120)
                    except ImageError:
                        run("umount base", ["umount", "-l", mnt], timeout=120)
        staging.copy_file_at(bfd, dest.kernel.name, dest.kernel, owners)
        with beneath.walked(bfd, dest.modules.name, directory=True) as mfd:
            staging.copy_tree_at(mfd, dest.modules)


def _read_env(rootdir: Path) -> dict[str, str]:
    """The environment a base template left in the tree (``ENV_FILE``), if any."""
    try:
        data = json.loads(safetree.read_file(rootdir, ENV_FILE) or b"{}")
    except (ValueError, ImageError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def _copy_in(rootdir: Path, f: TemplateFile) -> None:
    """One ``[[files]]`` entry into the tree, never through a link out of it."""
    if f.content is not None:
        put_file(rootdir, f.dest, f.content, 0o644 if f.mode is None else f.mode)
        return
    assert f.src is not None
    safetree.copy_in(f.src, rootdir, f.dest, f.mode)


def _apt_in_tree(rootdir: Path, packages: tuple[str, ...], layout: Layout, room: BuildRoom,
                 say: Progress) -> None:
    """``apt-get update`` and ``install`` of ``packages`` in the build namespace, with the
    host's network (the mirror) and resolver. The host's apt lists are copied in first
    (so the update mostly revalidates them); nothing the build writes goes back to the
    host's caches. The tree must be ``confined.shifted``."""
    say(f"apt-get install {' '.join(packages)}")
    lists = room.cached(AptCaches.of(layout).lists)
    if lists.is_dir():
        with flock(room.cached(layout.apt_lock)):
            for p in sorted(lists.iterdir()):
                if p.is_file() and not p.is_symlink() and "_" in p.name:
                    safetree.copy_in(p, rootdir, f"/var/lib/apt/lists/{p.name}", 0o644)
        _shift_owner(rootdir, "/var/lib/apt/lists")
    env = {"PATH": STEP_PATH, "DEBIAN_FRONTEND": "noninteractive", "LC_ALL": "C",
           "HOME": "/root"}
    opts: list[str] = []  # apt's own sandbox user (_apt) exists in the namespace's id map
    with _resolver(rootdir):
        confined.run_in_tree("apt-get update", rootdir,
                             ["/usr/bin/apt-get", *opts, "update", "-q"], env=env,
                             network=True, echo=False, timeout=1800)
        confined.run_in_tree("apt-get install", rootdir,
                             ["/usr/bin/apt-get", *opts, "install", "-y", "-q",
                              "--no-install-recommends", *packages], env=env, network=True,
                             progress=say, timeout=3600)
    confined.run_in_tree("apt-get clean", rootdir, ["/usr/bin/apt-get", "clean"], env=env,
                         echo=False, timeout=300)


def _shift_owner(rootdir: Path, folder: str) -> None:
    """Give what was just copied into ``folder`` to the build namespace's root."""
    fd = safetree.open_dir(rootdir, folder)
    try:
        for _p, dirs, files, dfd in beneath.fwalk(fd):
            for name in dirs + files:
                os.chown(name, confined.UID_BASE, confined.UID_BASE, dir_fd=dfd,
                         follow_symlinks=False)
    finally:
        os.close(fd)


@contextmanager
def _resolver(rootdir: Path) -> Iterator[None]:
    """The host's resolv.conf in the tree while a command with the network runs."""
    try:
        host = Path("/etc/resolv.conf").read_bytes()[:65536]
    except OSError:
        host = b""
    owner = (confined.UID_BASE, confined.UID_BASE)
    put_file(rootdir, "/etc/resolv.conf", host, 0o644, owner)
    try:
        yield
    finally:
        put_file(rootdir, "/etc/resolv.conf", RESOLV_PLACEHOLDER, 0o644, owner)


def _run_steps(rootdir: Path, steps: tuple[str, ...], env: dict[str, str],
               workdir: str | None, network: bool, say: Progress) -> None:
    """Each step as ``/bin/sh -c`` in the build namespace (``confined``), in ``workdir``,
    with the template's environment only. The tree must be ``confined.shifted``."""
    if safetree.lstat(rootdir, "/bin/sh", follow_last=True) is None:
        raise ImageError("the template's steps need /bin/sh, which the image lacks")
    clean = {"PATH": STEP_PATH, "HOME": "/root", "LANG": "C.UTF-8",
             "DEBIAN_FRONTEND": "noninteractive", **env}
    with _resolver(rootdir) if network else nullcontext():
        for i, step in enumerate(steps, 1):
            say(f"step {i}/{len(steps)}: {step if len(step) < 80 else step[:77] + '...'}")
            script = f"cd {shlex.quote(workdir or '/')} && {step}"
            confined.run_in_tree(f"step {i}", rootdir, ["/bin/sh", "-c", script], env=clean,
                                 network=network, progress=say, timeout=3600)


def remove_template(layout: Layout, name: str, pinned: set[str]) -> list[str]:
    """Forget template ``name``: remove its ``images/<name>`` link and every build of it
    that nothing pins (``pinned``: image ids) or uses; returns the ids removed.

    Raises NotFound when there is no such template, InvalidRequest for a recipe.
    """
    from hangar.errors import InvalidRequest
    from hangar.images.gc import collect

    if name in RECIPES:
        raise InvalidRequest(f"{name!r} is a recipe, not a template")
    link = layout.image_link(name)
    cur = current_build(layout, name)
    if cur is None or "template" not in read_manifest(cur):
        raise NotFound(f"no template named {name!r}", image=name)
    with image_lock(layout, name):
        link.unlink(missing_ok=True)
    result = collect(layout, pinned, only={name})
    return [i.id for i in result.removed]
