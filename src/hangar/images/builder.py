"""Building, listing and resolving guest images.

``build_image`` turns a recipe (``hangar.images.recipes``) into an image
directory, ``<data>/images/<name>-<digest>/`` (see ``hangar.layout``):

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
3. Fetch the kernel (``hangar.images.kernel``): vmlinuz and its modules.
4. Pack the tree with ``mkfs.ext4 -d`` into ``rootfs.ext4``, sized to the
   content plus 25 % (sandbox disks are larger qcow2 overlays; the guest init
   grows the filesystem at boot).
5. Build the initramfs (``hangar.images.initramfs``), write manifest.json,
   rename the staging directory (a dot-directory in ``<data>/images``) into
   place atomically and point the ``<name>`` symlink at it.

A build holds ``<data>/images/.<name>.lock`` (flock) so two processes do not
build the same recipe at once. Temporary trees are removed on success and on
failure; a failing step raises ``ImageError`` with the tail of its output.
An image whose directory exists is returned at once unless ``force``.

``resolve_image`` finds a built image and makes sure an initramfs exists for
the guest Python files of the running Hangar, building one (about a second)
when they changed: agent changes never need a rootfs rebuild.
"""

from __future__ import annotations

import fcntl
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

from hangar.errors import ImageError, NotFound
from hangar.images import initramfs, kernel
from hangar.images.commands import Progress, remove_tree, require_tools, run
from hangar.images.recipes import BUILDER_VERSION, RECIPES, Recipe, get_recipe
from hangar.layout import ImagePaths, Layout

DEBIAN_SOURCES = Path("/etc/apt/sources.list.d/debian.sources")
MANIFEST_FORMAT = 1
HEADROOM = 1.25
"""rootfs.ext4 is the content's size times this, plus room for the journal and inodes."""
KEEP_INITRDS = 16
"""initrd-<tag>.img files kept per image (newest first); older ones are deleted."""

KERNEL_CMDLINE = "console=ttyS0 root=/dev/vda rw panic=-1"
"""Kernel command line that boots these images (append ``hangar.*`` options)."""


@dataclass(frozen=True)
class GuestImage:
    """A built image, ready to boot: the paths a VMM needs."""

    name: str
    digest: str
    dir: Path
    kernel: Path
    initrd: Path
    """``initrd-<tag>.img`` for the current guest Python files."""
    rootfs: Path
    kernel_version: str
    cmdline: str = KERNEL_CMDLINE


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
    description: str
    kernel_version: str
    rootfs_bytes: int
    """Apparent size of rootfs.ext4 in bytes (it is sparse)."""
    built_at: float
    """Unix time in seconds."""
    build_seconds: float


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
    """Build the image of recipe ``name`` (cached by digest) and return it.

    Takes one to a few minutes (debootstrap) when not cached, well under a
    second when cached. ``progress`` receives one-line status messages.
    Raises ``NotFound`` for an unknown recipe, ``ImageError`` when a step fails.
    """
    recipe = get_recipe(name)
    digest = recipe.digest()
    final = layout.images / f"{name}-{digest}"
    say = progress or (lambda _msg: None)
    if not force and (final / "manifest.json").is_file():
        _point_symlink(layout, name, final)
        return _ensure_initrd(final, _read_manifest(final))
    require_tools("debootstrap", "mkfs.ext4", "apt-get", "apt-cache", "dpkg-deb", "depmod")
    layout.ensure()
    with _lock(layout, name):
        if not force and (final / "manifest.json").is_file():  # built while we waited
            _point_symlink(layout, name, final)
            return _ensure_initrd(final, _read_manifest(final))
        _build(layout, recipe, digest, final, say)
        _point_symlink(layout, name, final)
        return _ensure_initrd(final, _read_manifest(final))


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
        link = layout.images / name
        recipe = RECIPES.get(name)
        out.append(ImageInfo(
            name=name,
            digest=m["digest"],
            dir=d,
            current=link.is_symlink() and link.resolve() == d.resolve(),
            stale=recipe is None or recipe.digest() != m["digest"],
            description=m["recipe"].get("description", ""),
            kernel_version=m["kernel"]["version"],
            rootfs_bytes=m["sizes"]["rootfs_bytes"],
            built_at=m["built_at"],
            build_seconds=m["build_seconds"]["total"],
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
    p = layout.images / name
    if not (p / "manifest.json").is_file():
        hint = f" (build it with `hangar image build {name}`)" if name in RECIPES else ""
        raise NotFound(f"image {name!r} is not built{hint}", image=name)
    d = p.resolve()
    return _ensure_initrd(d, _read_manifest(d), sources)


# ---------------------------------------------------------------------------------------------
# internals


@contextmanager
def _lock(layout: Layout, name: str) -> Iterator[None]:
    with open(layout.images / f".{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _read_manifest(d: Path) -> dict[str, Any]:
    try:
        return json.loads((d / "manifest.json").read_text())
    except (OSError, ValueError) as e:
        raise ImageError(f"image {d.name}: unreadable manifest.json: {e}", image=d.name) from e


def _point_symlink(layout: Layout, name: str, target: Path) -> None:
    link = layout.images / name
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
    )


def _prune_initrds(paths: ImagePaths, keep: Path) -> None:
    olds = sorted((p for p in paths.dir.glob("initrd-*.img") if p != keep),
                  key=lambda p: p.stat().st_mtime, reverse=True)
    for p in olds[KEEP_INITRDS - 1:]:
        p.unlink(missing_ok=True)


def _build(layout: Layout, recipe: Recipe, digest: str, final: Path, say: Progress) -> None:
    t0 = time.monotonic()
    times: dict[str, float] = {}
    build_root = layout.cache / "build"
    build_root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{recipe.name}-{digest}-", dir=build_root))
    stage = Path(tempfile.mkdtemp(prefix=f".{recipe.name}-{digest}-", dir=layout.images))
    try:
        rootdir = work / "root"
        mirror = host_mirror(recipe.suite)
        say(f"{recipe.name}-{digest}: debootstrap {recipe.suite} ({recipe.variant} + "
            f"{len(recipe.packages)} packages)")
        _debootstrap(recipe, rootdir, mirror, layout.cache / "debootstrap", say)
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
        k = kernel.fetch(recipe.kernel_package, layout.cache / "debs", work, stage, say)
        times["kernel"] = time.monotonic() - t

        t = time.monotonic()
        content, inodes = _tree_size(rootdir)
        rootfs = ImagePaths(stage).rootfs
        size = _pack(rootdir, rootfs, content, inodes, say)
        times["pack"] = time.monotonic() - t
        remove_tree(rootdir)  # free the space before the rename

        times["total"] = time.monotonic() - t0
        manifest = {
            "format": MANIFEST_FORMAT,
            "name": recipe.name,
            "digest": digest,
            "builder_version": BUILDER_VERSION,
            "recipe": {**asdict(recipe), "packages": list(recipe.packages)},
            "mirror": mirror,
            "python_version": python_version,
            "kernel": {"meta_package": recipe.kernel_package, "package": k.package,
                       "deb_version": k.deb_version, "version": k.version},
            "sizes": {
                "rootfs_bytes": size,
                "rootfs_allocated_bytes": rootfs.stat().st_blocks * 512,
                "content_bytes": content,
                "content_inodes": inodes,
                "kernel_bytes": k.vmlinuz.stat().st_size,
                "modules_bytes": _tree_size(k.modules)[0],
            },
            "build_seconds": {k_: round(v, 2) for k_, v in times.items()},
            "built_at": time.time(),
        }
        (stage / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        t = time.monotonic()
        say("building the initramfs")
        _ensure_initrd(stage, manifest)
        stage.chmod(0o755)
        trash = None
        if final.exists():
            trash = layout.images / f".trash-{final.name}-{os.getpid()}"
            os.replace(final, trash)
        os.replace(stage, final)
        if trash is not None:
            remove_tree(trash)
        say(f"{final.name}: built in {time.monotonic() - t0:.0f} s, rootfs "
            f"{size / 2**20:.0f} MiB ({content / 2**20:.0f} MiB of files)")
    finally:
        remove_tree(work)
        remove_tree(stage)


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


def _apt_install(rootdir: Path, packages: tuple[str, ...], say: Progress) -> None:
    """``apt-get install`` ``packages`` inside the tree (chroot with /proc, /sys, /dev).

    The tree's apt sources are those debootstrap wrote (the same mirror);
    the host's resolver is lent for the duration. Everything is unmounted
    whatever happens.
    """
    say(f"apt-get install {' '.join(packages)}")
    resolv = rootdir / "etc" / "resolv.conf"
    if resolv.is_symlink() or resolv.exists():
        resolv.unlink()
    try:
        resolv.write_bytes(Path("/etc/resolv.conf").read_bytes())
    except OSError:
        pass
    mounts: list[Path] = []
    try:
        for fstype, src, target in (("proc", "proc", "proc"), ("sysfs", "sysfs", "sys"),
                                    (None, "/dev", "dev")):
            dest = rootdir / target
            dest.mkdir(exist_ok=True)
            argv = (["mount", "--bind", src, dest] if fstype is None
                    else ["mount", "-t", fstype, src, dest])
            run("mount", argv, timeout=60)
            mounts.append(dest)
        env = {"DEBIAN_FRONTEND": "noninteractive", "LC_ALL": "C"}
        run("apt-get update", ["chroot", rootdir, "apt-get", "update", "-q"], env=env,
            timeout=1800)
        run("apt-get install", ["chroot", rootdir, "apt-get", "install", "-y", "-q",
                                "--no-install-recommends", *packages],
            progress=say, echo=lambda ln: ln.startswith(("E: ", "W: ")), env=env, timeout=3600)
        run("apt-get clean", ["chroot", rootdir, "apt-get", "clean"], env=env, timeout=300)
    finally:
        for dest in reversed(mounts):
            try:
                run("umount", ["umount", "-l", dest], timeout=60)
            except ImageError:
                pass


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
    etc = root / "etc"
    (etc / "hostname").write_text("hangar\n")
    (etc / "hosts").write_text(
        "127.0.0.1\tlocalhost\n127.0.1.1\thangar\n"
        "::1\t\tlocalhost ip6-localhost ip6-loopback\n"
        "ff02::1\t\tip6-allnodes\nff02::2\t\tip6-allrouters\n")
    resolv = etc / "resolv.conf"
    if resolv.is_symlink() or resolv.exists():
        resolv.unlink()
    resolv.write_text("# Hangar: written at sandbox start when the sandbox has a network.\n")
    (etc / "fstab").write_text(
        "# Hangar: the initramfs mounts / and the guest init mounts the rest; nothing here.\n")
    (etc / "dpkg" / "dpkg.cfg.d").mkdir(parents=True, exist_ok=True)
    (etc / "dpkg" / "dpkg.cfg.d" / "01-hangar-nodoc").write_text(NODOC)
    (root / "root").mkdir(exist_ok=True)
    (root / "root").chmod(0o700)
    sbin = root / "usr" / "local" / "sbin"
    sbin.mkdir(parents=True, exist_ok=True)
    for cmd in ("poweroff", "halt", "reboot", "shutdown"):
        (sbin / cmd).write_text(POWEROFF_SHIM)
        (sbin / cmd).chmod(0o755)
    (root / "usr" / "lib" / "hangar" / "python").mkdir(parents=True, exist_ok=True)

    # Space: apt caches and lists, docs (but copyrights), man pages, locales, logs.
    for pattern in ("var/cache/apt/*.bin", "var/cache/apt/archives/*.deb",
                    "var/lib/apt/lists/*_*", "var/cache/debconf/*-old", "var/lib/dpkg/*-old",
                    "usr/share/man/*", "usr/share/info/*", "usr/share/lintian/*",
                    "var/log/bootstrap.log", "tmp/*", "var/tmp/*"):
        for p in root.glob(pattern):
            remove_tree(p) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)
    for p in (root / "usr/share/locale").glob("*"):
        if p.name != "locale.alias":
            remove_tree(p) if p.is_dir() else p.unlink(missing_ok=True)
    for p in (root / "usr/share/doc").rglob("*"):
        if p.is_file() and not p.is_symlink() and p.name != "copyright":
            p.unlink()
    for p in (root / "var/log").rglob("*"):
        if p.is_file():
            p.write_bytes(b"")


def _write_files(root: Path, recipe: Recipe) -> None:
    """Write the recipe's ``files`` into the tree (parents made as needed)."""
    for f in recipe.files:
        if not f.path.startswith("/") or ".." in f.path.split("/"):
            raise ImageError(f"recipe {recipe.name}: file path {f.path!r} must be absolute",
                             image=recipe.name)
        dest = root / f.path.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.unlink(missing_ok=True)
        dest.write_text(f.content)
        dest.chmod(f.mode)


def _python_version(root: Path) -> str | None:
    try:
        target = os.readlink(root / "usr/bin/python3")
    except OSError:
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
