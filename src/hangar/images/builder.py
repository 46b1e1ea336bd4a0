"""Building, listing and resolving guest images; a build is immutable.

``build_image`` turns a recipe (``hangar.images.recipes``) into an image
directory, ``<data>/images/<name>-<digest>/`` (see ``hangar.layout``), whose
name is the build's id:

1. ``debootstrap --variant=minbase --include=<packages> <suite>`` into a
   temporary tree under ``<data>/cache/build/`` (downloaded .debs are kept in
   ``<data>/cache/debootstrap/``), then ``apt-get install`` of the recipe's
   ``apt_packages`` inside the tree, when it has some. The mirror is the one the host's apt uses
   for that suite (the ``URIs:`` of the matching stanza of
   /etc/apt/sources.list.d/debian.sources), else debootstrap's default.
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

``resolve_image`` finds a built image by recipe name (its current build) or
id, and makes sure an initramfs exists for the guest Python files of the
running Hangar, building one (about a second) when they changed: agent
changes never need a rootfs rebuild. ``resolve_pinned`` finds exactly the
build a record names, or raises ``ImageMissing`` (409).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import re
import stat
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hangar.errors import ImageError, ImageMissing, NotFound
from hangar.images import initramfs, kernel, safetree, vmlinux
from hangar.images.commands import Progress, inside, remove_tree, require_tools, run
from hangar.images.guest_image import GuestImage, image_id
from hangar.images.initramfs import GUEST_PYTHON_DIR
from hangar.images.recipes import BUILDER_VERSION, RECIPES, Recipe, get_recipe
from hangar.layout import ImagePaths, Layout

DEBIAN_SOURCES = Path("/etc/apt/sources.list.d/debian.sources")
MANIFEST_FORMAT = 2
"""2: ``id``, ``digest`` of the built bytes, ``recipe_digest``, ``kernel.vmlinux``.
Format 1 (no ``id``): ``digest`` was the recipe's."""
DIGEST_HEX = 12
"""Hex digits of the content hash in an image id."""
HEADROOM = 1.25
"""rootfs.ext4 is the content's size times this, plus room for the journal and inodes."""
KEEP_INITRDS = 16
"""initrd-<tag>.img files kept per image (newest first); older ones are deleted."""

@dataclass(frozen=True)
class ImageInfo:
    """One built image directory, as listed by ``list_images``."""

    name: str
    digest: str
    dir: Path
    current: bool
    """The ``<name>`` symlink points here."""
    stale: bool
    """The recipe now has another digest (or no longer exists)."""
    recipe_digest: str
    bytes_on_disk: int
    """Allocated bytes of the whole directory."""
    description: str
    kernel_version: str
    rootfs_bytes: int
    """Apparent size of rootfs.ext4 in bytes (it is sparse)."""
    built_at: float
    """Unix time in seconds."""
    build_seconds: float
    template: bool = False
    """A template's build (``hangar template build``), not a recipe's."""

    @property
    def id(self) -> str:
        return self.dir.name


def host_mirror(suite: str, sources: Path = DEBIAN_SOURCES) -> str | None:
    """The first ``URIs:`` entry of the deb822 stanza of ``sources`` listing ``suite``."""
    try:
        text = sources.read_text()
    except OSError:
        return None
    for stanza in re.split(r"\n[ \t]*\n", text):
        fields: dict[str, str] = {}
        key = None
        for line in stanza.splitlines():
            if line.startswith("#"):
                continue
            if line[:1] in (" ", "\t") and key:
                fields[key] += " " + line.strip()
                continue
            k, sep, v = line.partition(":")
            if sep:
                key = k.strip().lower()
                fields[key] = v.strip()
        if fields.get("enabled", "yes").lower() == "no":
            continue
        if "deb" not in fields.get("types", "").split():
            continue
        if suite not in fields.get("suites", "").split():
            continue
        for uri in fields.get("uris", "").split():
            if uri.split(":", 1)[0] in ("http", "https", "file"):
                return uri
    return None


# ---------------------------------------------------------------------------------------------
# public API


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
        d = _current(layout, name)
        if d is not None and _recipe_digest(_read_manifest(d)) == rdigest:
            return _ensure_initrd(d, _read_manifest(d))
    require_tools("debootstrap", "mkfs.ext4", "apt-get", "apt-cache", "dpkg-deb", "depmod")
    layout.ensure()
    with image_lock(layout, name):
        d = None if force else _newest_build(layout, name, rdigest)
        if d is None:
            d = _build(layout, recipe, rdigest, say)
        _point_symlink(layout, name, d)
        return _ensure_initrd(d, _read_manifest(d))


def list_images(layout: Layout) -> list[ImageInfo]:
    """Every built image directory, sorted by name then build time."""
    out: list[ImageInfo] = []
    if not layout.images.is_dir():
        return out
    for d in layout.images.iterdir():
        if d.name.startswith(".") or d.is_symlink() or not d.is_dir():
            continue
        try:
            m = _read_manifest(d)
        except ImageError:
            continue
        name = m["name"]
        recipe = RECIPES.get(name)
        out.append(ImageInfo(
            name=name,
            digest=m["digest"],
            dir=d,
            current=_current(layout, name) == d.resolve(),
            # a template's file lives elsewhere: its builds are never called stale
            stale=False if "template" in m else (
                recipe is None or recipe.digest() != _recipe_digest(m)),
            recipe_digest=_recipe_digest(m),
            bytes_on_disk=_allocated(d),
            description=m["recipe"].get("description", ""),
            kernel_version=m["kernel"]["version"],
            rootfs_bytes=m["sizes"]["rootfs_bytes"],
            built_at=m["built_at"],
            build_seconds=m["build_seconds"]["total"],
            template="template" in m,
        ))
    return sorted(out, key=lambda i: (i.name, i.built_at))


def resolve_image(layout: Layout, name: str, *,
                  sources: Mapping[str, bytes] | None = None) -> GuestImage:
    """The built image ``name`` (a recipe name or ``<name>-<digest>``).

    Builds the initramfs for ``sources`` (default: this Hangar's guest
    Python files, ``initramfs.guest_sources()``) if it is missing; the
    ``initrd.img`` symlink is repointed for the default sources only.
    Raises ``NotFound`` when the image has not been built.
    """
    if not name or "/" in name or name.startswith("."):
        raise NotFound(f"no image named {name!r}", image=name)
    p = layout.image_dir(name)
    if not ImagePaths(p).manifest.is_file():
        hint = f" (build it with `hangar image build {name}`)" if name in RECIPES else ""
        raise NotFound(f"image {name!r} is not built{hint}", image=name)
    d = p.resolve()
    return _ensure_initrd(d, _read_manifest(d), sources)


def resolve_pinned(layout: Layout, name: str, digest: str, *,
                   sources: Mapping[str, bytes] | None = None) -> GuestImage:
    """Exactly the build ``<name>-<digest>`` that a sandbox, snapshot or machine pins.

    Never another build of the recipe: a disk overlay made over one build's
    rootfs must not be put over other bytes. Raises ``ImageMissing`` (409)
    when that build is gone (removed by hand: ``hangar image gc`` never
    removes a pinned one) or its manifest names another build.
    """
    iid = image_id(name, digest)
    paths = layout.image(iid)
    if not (name and digest) or "/" in iid or name.startswith(".") \
            or paths.dir.is_symlink() or not paths.manifest.is_file():
        raise ImageMissing(
            f"image build {iid} that this was made from no longer exists; it cannot be "
            "restored onto another build (its disk holds changes to that build's bytes)",
            image=name, image_digest=digest, image_id=iid)
    m = _read_manifest(paths.dir)
    if (m.get("name"), m.get("digest")) != (name, digest):
        raise ImageMissing(f"image directory {iid} holds build "
                           f"{m.get('name')}-{m.get('digest')}, not {iid}",
                           image=name, image_digest=digest, image_id=iid)
    return _ensure_initrd(paths.dir.resolve(), m, sources)


# ---------------------------------------------------------------------------------------------
# internals


@contextmanager
def image_lock(layout: Layout, name: str) -> Iterator[None]:
    """Hold recipe ``name``'s build lock (flock; blocks while a build of it runs)."""
    with open(layout.image_lock(name), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _read_manifest(d: Path) -> dict[str, Any]:
    try:
        return json.loads(ImagePaths(d).manifest.read_text())
    except (OSError, ValueError) as e:
        raise ImageError(f"image {d.name}: unreadable manifest.json: {e}", image=d.name) from e


def _recipe_digest(manifest: dict[str, Any]) -> str:
    """The recipe digest a build was made from (format 1 kept it in ``digest``)."""
    return str(manifest.get("recipe_digest") or manifest.get("digest", ""))


def _current(layout: Layout, name: str) -> Path | None:
    """The build the ``<name>`` symlink points at, if it has a manifest."""
    link = layout.image_link(name)
    if not link.is_symlink():
        return None
    d = link.resolve()
    return d if ImagePaths(d).manifest.is_file() else None


def _builds(layout: Layout) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Every finished build directory and its manifest."""
    if not layout.images.is_dir():
        return
    for d in layout.images.iterdir():
        if d.name.startswith(".") or d.is_symlink() or not d.is_dir():
            continue
        try:
            yield d, _read_manifest(d)
        except ImageError:
            continue


def _newest_build(layout: Layout, name: str, recipe_digest: str) -> Path | None:
    """The current build of ``name`` if made from ``recipe_digest``, else the newest one."""
    cur = _current(layout, name)
    if cur is not None and _recipe_digest(_read_manifest(cur)) == recipe_digest:
        return cur
    found = [(m.get("built_at", 0.0), d) for d, m in _builds(layout)
             if m.get("name") == name and _recipe_digest(m) == recipe_digest]
    return max(found)[1] if found else None


def _allocated(d: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(d):
        for n in files:
            try:
                total += os.lstat(os.path.join(dirpath, n)).st_blocks * 512
            except OSError:
                pass
    return total


def content_digest(d: Path) -> str:
    """SHA-256 (hex) of a build's bytes: rootfs.ext4, vmlinuz and the modules tree.

    Each file adds its path relative to ``d``, its size and its SHA-256, in
    sorted order; symlinks add their target. ``vmlinux`` (a function of
    vmlinuz), the initramfs and the manifest are left out. About a second
    per GB. Raises OSError.
    """
    paths = ImagePaths(d)
    files = [paths.rootfs, paths.kernel]
    for dirpath, dirnames, filenames in os.walk(paths.modules):
        dirnames.sort()
        files += [Path(dirpath) / n for n in sorted(filenames)]
    h = hashlib.sha256()
    for f in files:
        rel = f.relative_to(d).as_posix()
        if f.is_symlink():
            h.update(f"L {rel} {os.readlink(f)}\0".encode())
            continue
        fh = hashlib.sha256()
        with open(f, "rb") as src:
            for block in iter(lambda: src.read(1 << 20), b""):
                fh.update(block)
        h.update(f"F {rel} {f.stat().st_size} {fh.hexdigest()}\0".encode())
    return h.hexdigest()


def _point_symlink(layout: Layout, name: str, target: Path) -> None:
    link = layout.image_link(name)
    if link.is_symlink() and os.readlink(link) == target.name:
        return
    if link.exists() and not link.is_symlink():
        raise ImageError(f"{link} exists and is not a symlink", image=name)
    tmp = layout.images / f".{name}.link-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    os.symlink(target.name, tmp)
    os.replace(tmp, link)


def _ensure_initrd(d: Path, manifest: dict[str, Any],
                   sources: Mapping[str, bytes] | None = None) -> GuestImage:
    paths = ImagePaths(d)
    kver = manifest["kernel"]["version"]
    pyver = manifest.get("python_version")
    own = sources is None
    sources = initramfs.guest_sources() if sources is None else sources
    tag = initramfs.initrd_tag(sources, kver, python_version=pyver)
    initrd = paths.initrd_for(tag)
    if not initrd.is_file():
        initramfs.build_initrd(initrd, modules_dir=paths.modules / kver, kernel_version=kver,
                               sources=sources, python_version=pyver)
        _prune_initrds(paths, keep=initrd)
    link = paths.initrd  # follows this Hangar's own guest files only
    if own and not (link.is_symlink() and os.readlink(link) == initrd.name):
        tmp = d / f".initrd.link-{os.getpid()}"
        tmp.unlink(missing_ok=True)
        os.symlink(initrd.name, tmp)
        os.replace(tmp, link)
    return GuestImage(
        name=manifest["name"], digest=manifest["digest"], dir=d, kernel=paths.kernel,
        initrd=initrd, rootfs=paths.rootfs, kernel_version=kver,
        recipe_digest=_recipe_digest(manifest), vmlinux=vmlinux.recorded(paths, manifest),
        template=manifest.get("template") or _recipe_runtime(manifest),
    )


def _recipe_runtime(manifest: dict[str, Any]) -> dict[str, Any] | None:
    """A recipe build's start command and ready check (``Recipe.runtime``), if it has one."""
    recipe = RECIPES.get(manifest["name"])
    return recipe.runtime() if recipe is not None else None


def _prune_initrds(paths: ImagePaths, keep: Path) -> None:
    olds = sorted((p for p in paths.dir.glob("initrd-*.img") if p != keep),
                  key=lambda p: p.stat().st_mtime, reverse=True)
    for p in olds[KEEP_INITRDS - 1:]:
        p.unlink(missing_ok=True)


def _build(layout: Layout, recipe: Recipe, recipe_digest: str, say: Progress) -> Path:
    """Make a new build of ``recipe``; returns its directory ``<name>-<content digest>``."""
    t0 = time.monotonic()
    times: dict[str, float] = {}
    layout.build_cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{recipe.name}-{recipe_digest}-",
                                 dir=layout.build_cache))
    stage = Path(tempfile.mkdtemp(prefix=layout.image_staging_prefix(recipe.name),
                                  dir=layout.images))
    paths = ImagePaths(stage)
    try:
        rootdir = work / "root"
        mirror = host_mirror(recipe.suite)
        say(f"{recipe.name} (recipe {recipe_digest}): debootstrap {recipe.suite} "
            f"({recipe.variant} + {len(recipe.packages)} packages)")
        _debootstrap(recipe, rootdir, mirror, layout.debootstrap_cache, say)
        if recipe.apt_packages:
            _apt_install(rootdir, recipe.apt_packages, say)
        times["debootstrap"] = time.monotonic() - t0

        t = time.monotonic()
        say("setting up the rootfs")
        _configure_rootfs(rootdir)
        _write_files(rootdir, recipe)
        python_version = _python_version(rootdir)
        times["configure"] = time.monotonic() - t

        t = time.monotonic()
        k = kernel.fetch(recipe.kernel_package, layout.debs_cache, work, stage, say)
        elf = vmlinux.write_vmlinux(paths)
        times["kernel"] = time.monotonic() - t

        manifest = {
            "recipe_digest": recipe_digest,
            "recipe": {**asdict(recipe), "packages": list(recipe.packages)},
            "mirror": mirror,
            "python_version": python_version,
            "kernel": {"meta_package": recipe.kernel_package, "package": k.package,
                       "deb_version": k.deb_version, "version": k.version, "vmlinux": elf},
        }
        return finish_build(layout, recipe.name, stage, rootdir, manifest, say, times, t0)
    finally:
        remove_tree(work)
        remove_tree(stage)


def finish_build(layout: Layout, name: str, stage: Path, rootdir: Path,
                 manifest: dict[str, Any], say: Progress, times: dict[str, float],
                 t0: float) -> Path:
    """Pack ``rootdir`` into the staging build ``stage`` and give it its id.

    ``stage`` already holds the kernel (vmlinuz, vmlinux, modules/);
    ``manifest`` holds the build's own fields (``recipe_digest``, ``recipe``,
    ``kernel``, ``python_version``, ...), to which this adds the id, digests,
    sizes and times. Packs rootfs.ext4 (removing ``rootdir`` after), hashes
    the built bytes, writes manifest.json, builds the initramfs and renames
    ``stage`` to ``images/<name>-<digest>``, which it returns (an existing
    build of the very same bytes is kept instead). Raises ImageError.
    """
    paths = ImagePaths(stage)
    t = time.monotonic()
    content, inodes = _tree_size(rootdir)
    size = _pack(rootdir, paths.rootfs, content, inodes, say)
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
            "modules_bytes": _tree_size(paths.modules / kver)[0],
        },
        "build_seconds": {k_: round(v, 2) for k_, v in times.items()},
        "built_at": time.time(),
    }
    paths.manifest.write_text(json.dumps(manifest, indent=2) + "\n")
    say("building the initramfs")
    _ensure_initrd(stage, manifest)
    stage.chmod(0o755)
    if final.exists():  # the very same bytes were built before: keep that build
        say(f"{final.name}: identical to the existing build")
        return final
    os.replace(stage, final)
    from hangar.privileged.split import hand_new

    hand_new(layout.root, final)  # built by root while a split server runs
    say(f"{final.name}: built in {time.monotonic() - t0:.0f} s, rootfs "
        f"{size / 2**20:.0f} MiB ({content / 2**20:.0f} MiB of files)")
    return final


def _debootstrap(recipe: Recipe, rootdir: Path, mirror: str | None, cache: Path,
                 say: Progress) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    argv: list[str | Path] = ["debootstrap", f"--variant={recipe.variant}",
                              f"--cache-dir={cache.resolve()}"]
    if recipe.packages:
        argv.append(f"--include={','.join(recipe.packages)}")
    argv += [recipe.suite, rootdir]
    if mirror:
        argv.append(mirror)
    run("debootstrap", argv, progress=say, echo=lambda ln: ln.startswith(("I: ", "W: ", "E: ")),
        timeout=3600)


@contextmanager
def chroot_mounts(rootdir: Path, binds: Mapping[str, Path] | None = None) -> Iterator[None]:
    """/proc, /sys and /dev in the tree (and ``binds``: path in the tree -> host folder),
    plus the host's resolver, for commands run in it with ``chroot``.

    Everything is unmounted and /etc/resolv.conf emptied whatever happens
    (the guest writes its own at boot when it has a network).
    """
    try:
        host_resolv = Path("/etc/resolv.conf").read_bytes()
    except OSError:
        host_resolv = b""
    put_file(rootdir, "/etc/resolv.conf", host_resolv)
    mounts: list[Path] = []
    try:
        for fstype, src, target in (("proc", "proc", "/proc"), ("sysfs", "sysfs", "/sys"),
                                    (None, "/dev", "/dev"), *((None, str(h), t) for t, h in
                                                              (binds or {}).items())):
            # Mount only on real folders of the tree: a link could point at the host's.
            dest = inside(rootdir, target)
            if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
                dest.unlink()
            dest.mkdir(parents=True, exist_ok=True)
            argv: list[str | Path] = (["mount", "--bind", src, dest] if fstype is None
                                      else ["mount", "-t", fstype, src, dest])
            run("mount", argv, timeout=60)
            mounts.append(dest)
        yield
    finally:
        for dest in reversed(mounts):
            try:
                run("umount", ["umount", "-l", dest], timeout=60)
            except ImageError:
                pass
        put_file(rootdir, "/etc/resolv.conf", RESOLV_PLACEHOLDER)


@dataclass(frozen=True)
class AptCaches:
    """Host folders apt may share between builds: .debs and package lists, under a lock."""

    archives: Path
    lists: Path
    lock: Path

    @classmethod
    def of(cls, layout: Layout) -> "AptCaches":
        return cls(layout.debootstrap_cache, layout.apt_lists_cache, layout.apt_lock)


def _apt_install(rootdir: Path, packages: tuple[str, ...], say: Progress,
                 caches: AptCaches | None = None) -> None:
    """``apt-get install`` ``packages`` inside the tree (chroot with /proc, /sys, /dev).

    The tree's apt sources are those debootstrap wrote (the same mirror);
    the host's resolver is lent for the duration. With ``caches``, apt's
    archives and lists are the host's shared folders (bind-mounted, under
    their flock), so .debs fetched once (by debootstrap or an earlier build)
    are reused and nothing is left in the tree; else the tree's own, cleaned
    after.
    """
    say(f"apt-get install {' '.join(packages)}")
    env = {"DEBIAN_FRONTEND": "noninteractive", "LC_ALL": "C"}
    opts = ["-o", "APT::Sandbox::User=root"]
    binds: dict[str, Path] = {}
    if caches is not None:
        for d in (caches.archives / "partial", caches.lists / "partial"):
            d.mkdir(parents=True, exist_ok=True)
        binds = {"/var/cache/apt/archives": caches.archives, "/var/lib/apt/lists": caches.lists}
    with _flock(caches.lock if caches else None), chroot_mounts(rootdir, binds):
        run("apt-get update", ["chroot", rootdir, "apt-get", *opts, "update", "-q"], env=env,
            timeout=1800)
        run("apt-get install", ["chroot", rootdir, "apt-get", *opts, "install", "-y", "-q",
                                "--no-install-recommends", *packages],
            progress=say, echo=lambda ln: ln.startswith(("E: ", "W: ", "Get:", "Setting up ")),
            env=env, timeout=3600)
        if caches is None:
            run("apt-get clean", ["chroot", rootdir, "apt-get", "clean"], env=env, timeout=300)


@contextmanager
def _flock(path: Path | None) -> Iterator[None]:
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


RESOLV_PLACEHOLDER = "# Hangar: written at sandbox start when the sandbox has a network.\n"

POWEROFF_SHIM = """#!/bin/sh
# Hangar guests have no init system: PID 1 (hangar.guest.init) powers off on SIGTERM.
exec kill -TERM 1
"""

NODOC = """# Hangar: keep docs, man pages and translations out of the sandbox image.
path-exclude=/usr/share/doc/*
path-include=/usr/share/doc/*/copyright
path-exclude=/usr/share/man/*
path-exclude=/usr/share/info/*
path-exclude=/usr/share/locale/*
path-include=/usr/share/locale/locale.alias
path-exclude=/usr/share/lintian/*
"""


def _configure_rootfs(root: Path) -> None:
    guest_setup(root)
    _trim(root)


def put_file(root: Path, path: str, data: bytes | str, mode: int | None = None,
             owner: tuple[int, int] | None = None) -> None:
    """Write a file at the guest path ``path`` of the tree ``root`` (parents made, a link
    or file there replaced), never outside the tree (``hangar.images.safetree``);
    ``owner`` is its (uid, gid) when given."""
    safetree.write_file(root, path, data, 0o644 if mode is None else mode, owner)


def guest_setup(root: Path) -> None:
    """What every Hangar guest's tree needs (Debian or not): host name and hosts, an
    empty resolv.conf and fstab, ``poweroff``-style commands that signal PID 1 (when the
    tree has /bin/sh), /root, and the folder the initramfs puts the guest's Python in."""
    put_file(root, "/etc/hostname", "hangar\n")
    put_file(root, "/etc/hosts",
             "127.0.0.1\tlocalhost\n127.0.1.1\thangar\n"
             "::1\t\tlocalhost ip6-localhost ip6-loopback\n"
             "ff02::1\t\tip6-allnodes\nff02::2\t\tip6-allrouters\n")
    put_file(root, "/etc/resolv.conf", RESOLV_PLACEHOLDER)
    put_file(root, "/etc/fstab",
             "# Hangar: the initramfs mounts / and the guest init mounts the rest; "
             "nothing here.\n")
    safetree.make_dirs(root, "/root", 0o700)
    if safetree.lstat(root, "/bin/sh", follow_last=True) is not None:
        for cmd in ("poweroff", "halt", "reboot", "shutdown"):
            put_file(root, f"/usr/local/sbin/{cmd}", POWEROFF_SHIM, 0o755)
    safetree.make_dirs(root, GUEST_PYTHON_DIR)


TRIM = (("/var/cache/apt", "*.bin"), ("/var/cache/apt/archives", "*.deb"),
        ("/var/lib/apt/lists", "*_*"), ("/var/cache/debconf", "*-old"),
        ("/var/lib/dpkg", "*-old"), ("/usr/share/man", "*"), ("/usr/share/info", "*"),
        ("/usr/share/lintian", "*"), ("/var/log", "bootstrap.log"), ("/tmp", "*"),
        ("/var/tmp", "*"))
"""(folder, glob) of what ``_trim`` removes."""


def _trim(root: Path) -> None:
    """Leave out of a Debian tree what a sandbox never needs: docs (but copyrights), man
    pages, locales, apt caches and lists, logs; and keep dpkg from adding them back.

    Works through ``safetree``: a tree whose ``usr/share/doc`` or ``var/log`` is a link
    to the host's trims inside the tree only.
    """
    put_file(root, "/etc/dpkg/dpkg.cfg.d/01-hangar-nodoc", NODOC)
    for folder, pattern in TRIM:
        safetree.remove_matching(root, folder, pattern)
    safetree.remove_matching(root, "/usr/share/locale", "*", keep=frozenset({"locale.alias"}))
    for dfd, name, st in safetree.files_under(root, "/usr/share/doc"):
        if stat.S_ISREG(st.st_mode) and name != "copyright":
            os.unlink(name, dir_fd=dfd)
    for dfd, name, st in safetree.files_under(root, "/var/log"):
        if stat.S_ISREG(st.st_mode):
            fd = os.open(name, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         dir_fd=dfd)
            try:
                os.ftruncate(fd, 0)
            finally:
                os.close(fd)


def _write_files(root: Path, recipe: Recipe) -> None:
    """Write the recipe's ``files`` into the tree (parents made as needed)."""
    for f in recipe.files:
        if not f.path.startswith("/") or ".." in f.path.split("/"):
            raise ImageError(f"recipe {recipe.name}: file path {f.path!r} must be absolute",
                             image=recipe.name)
        put_file(root, f.path, f.content, f.mode)


def python_version(root: Path) -> str | None:
    """The tree's ``/usr/bin/python3`` version (``"3.11"``), or None."""
    return _python_version(root)


def _python_version(root: Path) -> str | None:
    target = safetree.readlink(root, "/usr/bin/python3")
    if target is None:
        return None
    m = re.fullmatch(r"(?:.*/)?python(\d+\.\d+)", target)
    return m.group(1) if m else None


def _tree_size(root: Path) -> tuple[int, int]:
    """(bytes the tree needs in 4 KiB blocks, number of inodes)."""
    total = 0
    inodes = 0
    seen: set[tuple[int, int]] = set()
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, n))
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            inodes += 1
            if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):
                total += max(4096, -(-st.st_size // 4096) * 4096)
            elif stat.S_ISLNK(st.st_mode) and st.st_size > 59:
                total += 4096  # longer targets than fit in the inode
    return total, inodes + 1


def _pack(rootdir: Path, image: Path, content: int, inodes: int, say: Progress) -> int:
    """mkfs.ext4 -d the tree into ``image``; return its size in bytes."""
    n_inodes = max(16384, int(inodes * 1.5))
    size = content * HEADROOM + n_inodes * 256 + 24 * 2**20  # + journal and metadata
    for attempt in range(3):
        size_mib = math.ceil(size / 2**20)
        say(f"packing rootfs.ext4 ({size_mib} MiB)")
        image.unlink(missing_ok=True)
        with open(image, "wb") as f:
            f.truncate(size_mib * 2**20)
        try:
            # -b 4096: for a file this small mke2fs would pick 1 KiB blocks
            # (its "small" type), slower and worse for the online growth at boot.
            run("mkfs.ext4", ["mkfs.ext4", "-q", "-F", "-L", "hangar-root", "-b", "4096",
                              "-m", "0", "-N", str(n_inodes), "-d", rootdir, image], timeout=900)
            return image.stat().st_size
        except ImageError as e:
            if attempt == 2 or "space" not in e.message.lower() and "allocate" not in e.message:
                raise
            size *= 1.3
    raise AssertionError("unreachable")
