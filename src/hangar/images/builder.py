"""Building a recipe into a guest image, step by step; a build is immutable.

``build_image`` turns a recipe (``hangar.images.recipes``) into an image
directory, ``<data>/images/<name>-<digest>/`` (see ``hangar.layout``), whose
name is the build's id:

1. ``debootstrap --variant=minbase --include=<packages> <suite>`` into a
   temporary tree under ``<data>/cache/build/`` (downloaded .debs are kept in
   ``<data>/cache/debootstrap/``), then ``apt-get install`` of the recipe's
   ``apt_packages`` inside the tree, when it has some. The mirror is the one the host's apt uses
   for that suite (the ``URIs:`` of the matching stanza of
   /etc/apt/sources.list.d/debian.sources), else debootstrap's default.
   Where the tree has ``bash-static``, ``/bin/bash`` becomes it
   (``hangar.images.debian.static_bash``), and its ``C.UTF-8`` locale goes into
   glibc's locale archive (``hangar.images.debian.locale_archive``).
2. Set the tree up for a VM without an init system: hostname, hosts, an
   empty resolv.conf and fstab, ``poweroff``-style commands that signal PID 1,
   a dpkg filter that keeps docs out, and no apt caches, docs or locales;
   then write the recipe's ``files``.
3. Fetch the kernel (``hangar.images.kernel``): vmlinuz and its modules,
   and unpack the ELF ``vmlinux`` that Firecracker boots
   (``hangar.images.vmlinux``).
4. Pack the tree with ``mkfs.ext4 -d`` into ``rootfs.ext4``, sized to the
   content plus 25 % (sandbox disks are larger qcow2 overlays; the guest init
   grows the filesystem at boot).
5. Hash the built bytes (``content_digest``: rootfs.ext4, vmlinuz and the
   modules tree) into the build's digest, build the initramfs
   (``hangar.images.initramfs``), write manifest.json, rename the staging
   directory (``.staging-<name>-*`` in ``<data>/images``) to
   ``<name>-<digest>`` atomically and point the ``<name>`` symlink at it.

Root beside a split server: the work tree and the staging directory are
root's own (0700), made and held by descriptor (``hangar.images.staging``);
every tool is given a path through those descriptors and the build is
published by ``renameat`` relative to the descriptor of ``images``, so the
server, which owns ``<data>``, ``images`` and ``cache``, cannot swap a name
under the build.

Immutability: a build's directory is never replaced or rewritten. mkfs.ext4
stamps each filesystem with a new UUID and times, so every build has new
bytes and a new id; ``force`` therefore makes a new build beside the old one
and moves the ``<name>`` symlink, and sandboxes, snapshots and machines made
from the old build keep it (they record its id: name and digest) until
``hangar.images.gc`` removes it once nothing pins it. A disk overlay thus
always sits on the bytes it was made over. The initramfs is not part of
the id (its own ``<tag>`` hashes its inputs): it carries this Hangar's guest
files, is loaded into RAM at boot, no disk is layered on it, and a
restored guest never reads it again. Builds made before ids covered the
bytes are named ``<name>-<recipe digest>``; they are used as they are.

A build holds ``<data>/images/.<name>.lock`` (flock) so two processes do not
build the same recipe at once. Temporary trees are removed on success and on
failure; a failing step raises ``ImageError`` with the tail of its output.
Without ``force``, a build of the recipe's current digest is reused.

The build's parts, one module each: ``hangar.images.debian`` (step 1),
``hangar.images.rootfs`` (step 2), ``hangar.images.packing`` (step 4 and the
hash of step 5), ``hangar.images.catalogue`` (the builds on disk: manifests,
symlinks, the initramfs; ``list_images``, ``resolve_image``, ``resolve_pinned``).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hangar.images import kernel, vmlinux
from hangar.images.catalogue import (
    current_build, ensure_initrd, image_lock, newest_build, point_symlink, read_manifest,
    recipe_digest_of,
)
from hangar.images.commands import Progress, remove_tree, require_tools
from hangar.images.debian import (
    apt_install, debootstrap, host_mirror, locale_archive, static_bash, unsafe_io,
)
from hangar.images.guest_image import GuestImage, image_id
from hangar.images.packing import content_digest, pack, tree_size
from hangar.images.recipes import BUILDER_VERSION, Recipe, get_recipe
from hangar.images.rootfs import configure_rootfs, python_version, write_files
from hangar.images.staging import BuildRoom, image_at
from hangar.layout import ImagePaths, Layout

MANIFEST_FORMAT = 2
"""2: ``id``, ``digest`` of the built bytes, ``recipe_digest``, ``kernel.vmlinux``.
Format 1 (no ``id``): ``digest`` was the recipe's."""
DIGEST_HEX = 12
"""Hex digits of the content hash in an image id."""


def build_image(layout: Layout, name: str, *, force: bool = False,
                progress: Progress | None = None) -> GuestImage:
    """Build recipe ``name`` into a new immutable build, or reuse one; return it.

    Without ``force`` a build of the recipe's current digest is reused (well
    under a second); otherwise, or when there is none, a new build is made
    (one to a few minutes, debootstrap) with a new id, and the ``<name>``
    symlink moves to it. Older builds are left for ``hangar.images.gc``.
    ``progress`` receives one-line status messages. Raises ``NotFound`` for
    an unknown recipe, ``ImageError`` when a step fails. (``hangar image
    build`` then makes the build's template snapshot: ``hangar.core.templates``.)
    """
    recipe = get_recipe(name)
    rdigest = recipe.digest()
    say = progress or (lambda _msg: None)
    if not force:
        d = current_build(layout, name)
        if d is not None and recipe_digest_of(read_manifest(d)) == rdigest:
            return image_at(layout, d.name)
    require_tools("debootstrap", "mkfs.ext4", "apt-get", "apt-cache", "dpkg-deb", "depmod")
    layout.ensure()
    with image_lock(layout, name):
        d = None if force else newest_build(layout, name, rdigest)
        if d is None:
            d = _build(layout, recipe, rdigest, say)
        point_symlink(layout, name, d)
        return image_at(layout, d.name)


def _build(layout: Layout, recipe: Recipe, recipe_digest: str, say: Progress) -> Path:
    """Make a new build of ``recipe``; returns its directory ``<name>-<content digest>``.
    Staged in a ``BuildRoom``: every tool works through root's own descriptors."""
    t0 = time.monotonic()
    times: dict[str, float] = {}
    with BuildRoom(layout, recipe.name, f"{recipe.name}-{recipe_digest}-") as room:
        work, stage = room.work, room.stage
        paths = ImagePaths(stage)
        rootdir = work / "root"
        mirror = host_mirror(recipe.suite)
        say(f"{recipe.name} (recipe {recipe_digest}): debootstrap {recipe.suite} "
            f"({recipe.variant} + {len(recipe.packages)} packages)")
        with unsafe_io(rootdir):
            debootstrap(recipe, rootdir, mirror, room.cached(layout.debootstrap_cache), say,
                        lock=room.cached(layout.apt_lock))
            if recipe.apt_packages:
                apt_install(rootdir, recipe.apt_packages, say)
            static_bash(rootdir, say)
            locale_archive(rootdir, say)
        times["debootstrap"] = time.monotonic() - t0

        t = time.monotonic()
        say("setting up the rootfs")
        configure_rootfs(rootdir)
        write_files(rootdir, recipe)
        pyver = python_version(rootdir)
        times["configure"] = time.monotonic() - t

        t = time.monotonic()
        k = kernel.fetch(recipe.kernel_package, room.cached(layout.debs_cache), work, stage,
                         say, lock=room.cached(layout.apt_lock))
        elf = vmlinux.write_vmlinux(paths)
        times["kernel"] = time.monotonic() - t

        manifest = {
            "recipe_digest": recipe_digest,
            "recipe": {**asdict(recipe), "packages": list(recipe.packages)},
            "mirror": mirror,
            "python_version": pyver,
            "kernel": {"meta_package": recipe.kernel_package, "package": k.package,
                       "deb_version": k.deb_version, "version": k.version, "vmlinux": elf},
        }
        return finish_build(layout, recipe.name, room, rootdir, manifest, say, times, t0)


def finish_build(layout: Layout, name: str, room: BuildRoom, rootdir: Path,
                 manifest: dict[str, Any], say: Progress, times: dict[str, float],
                 t0: float) -> Path:
    """Pack ``rootdir`` into the staging build of ``room`` and give it its id.

    The staging folder (``room.stage``) already holds the kernel (vmlinuz, vmlinux, modules/);
    ``manifest`` holds the build's own fields (``recipe_digest``, ``recipe``,
    ``kernel``, ``python_version``, ...), to which this adds the id, digests,
    sizes and times. Packs rootfs.ext4 (removing ``rootdir`` after), hashes
    the built bytes, writes manifest.json, builds the initramfs and publishes the
    staging folder as ``images/<name>-<digest>`` (``BuildRoom.publish``), which it
    returns (an existing build of the very same bytes is kept instead). Raises
    ImageError.
    """
    stage = room.stage
    paths = ImagePaths(stage)
    t = time.monotonic()
    content, inodes = tree_size(rootdir)
    size = pack(rootdir, paths.rootfs, content, inodes, say)
    times["pack"] = time.monotonic() - t
    remove_tree(rootdir)  # free the space before the rename

    t = time.monotonic()
    say("hashing the built bytes")
    sha256 = content_digest(stage)
    digest = sha256[:DIGEST_HEX]
    times["hash"] = time.monotonic() - t
    final = layout.images / image_id(name, digest)

    times["total"] = time.monotonic() - t0
    kver = manifest["kernel"]["version"]
    manifest = {
        "format": MANIFEST_FORMAT,
        "id": final.name,
        "name": name,
        "digest": digest,
        "sha256": sha256,
        "builder_version": BUILDER_VERSION,
        **manifest,
        "sizes": {
            "rootfs_bytes": size,
            "rootfs_allocated_bytes": paths.rootfs.stat().st_blocks * 512,
            "content_bytes": content,
            "content_inodes": inodes,
            "kernel_bytes": paths.kernel.stat().st_size,
            "modules_bytes": tree_size(paths.modules / kver)[0],
        },
        "build_seconds": {k_: round(v, 2) for k_, v in times.items()},
        "built_at": time.time(),
    }
    paths.manifest.write_text(json.dumps(manifest, indent=2) + "\n")
    say("building the initramfs")
    ensure_initrd(stage, manifest)
    if not room.publish(final.name):  # the very same bytes were built before: keep that
        say(f"{final.name}: identical to the existing build")
        return final
    from hangar.privileged.split import hand_new

    hand_new(layout.root, final)  # built by root while a split server runs
    say(f"{final.name}: built in {time.monotonic() - t0:.0f} s, rootfs "
        f"{size / 2**20:.0f} MiB ({content / 2**20:.0f} MiB of files)")
    return final
