"""The builds on disk: listing, resolving and pinning images, their manifests, the
``<name>`` symlinks and the initramfs for the guest files in use.

A build is a directory ``<data>/images/<name>-<digest>/`` (see ``hangar.layout``)
made once by ``hangar.images.builder`` (recipes) or
``hangar.images.template_builder`` (templates) and never rewritten; its
``manifest.json`` says what it is. The ``<name>`` symlink points at a name's
current build (``point_symlink``), and ``image_lock`` is a name's build lock
(``<data>/images/.<name>.lock``, flock), held by builds and by ``hangar.images.gc``.

``resolve_image`` finds a built image by recipe name (its current build) or
id, and makes sure an initramfs exists for the guest Python files of the
running Hangar, building one (about a second) when they changed: agent
changes never need a rootfs rebuild. ``resolve_pinned`` finds exactly the
build a record names, or raises ``ImageMissing`` (409).
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hangar.errors import ImageError, ImageMissing, NotFound
from hangar.images import initramfs, vmlinux
from hangar.images.guest_image import GuestImage, image_id
from hangar.images.recipes import RECIPES
from hangar.layout import ImagePaths, Layout

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


def list_images(layout: Layout) -> list[ImageInfo]:
    """Every built image directory, sorted by name then build time."""
    out: list[ImageInfo] = []
    if not layout.images.is_dir():
        return out
    for d in layout.images.iterdir():
        if d.name.startswith(".") or d.is_symlink() or not d.is_dir():
            continue
        try:
            m = read_manifest(d)
        except ImageError:
            continue
        name = m["name"]
        recipe = RECIPES.get(name)
        out.append(ImageInfo(
            name=name,
            digest=m["digest"],
            dir=d,
            current=current_build(layout, name) == d.resolve(),
            # a template's file lives elsewhere: its builds are never called stale
            stale=False if "template" in m else (
                recipe is None or recipe.digest() != recipe_digest_of(m)),
            recipe_digest=recipe_digest_of(m),
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
    return ensure_initrd(d, read_manifest(d), sources)


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
    m = read_manifest(paths.dir)
    if (m.get("name"), m.get("digest")) != (name, digest):
        raise ImageMissing(f"image directory {iid} holds build "
                           f"{m.get('name')}-{m.get('digest')}, not {iid}",
                           image=name, image_digest=digest, image_id=iid)
    return ensure_initrd(paths.dir.resolve(), m, sources)


@contextmanager
def image_lock(layout: Layout, name: str) -> Iterator[None]:
    """Hold recipe ``name``'s build lock (flock; blocks while a build of it runs). The
    lock file is opened relative to a descriptor of ``images`` without following a link
    and never truncated (a split server owns ``images``). Raises OSError."""
    from hangar.privileged import beneath

    lock = layout.image_lock(name)
    images = beneath.open_trusted(lock.parent)
    try:
        fd = beneath.walk(images, lock.name, os.O_WRONLY | os.O_CREAT, mode=0o644)
    finally:
        os.close(images)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def read_manifest(d: Path) -> dict[str, Any]:
    try:
        return json.loads(ImagePaths(d).manifest.read_text())
    except (OSError, ValueError) as e:
        raise ImageError(f"image {d.name}: unreadable manifest.json: {e}", image=d.name) from e


def recipe_digest_of(manifest: dict[str, Any]) -> str:
    """The recipe digest a build was made from (format 1 kept it in ``digest``)."""
    return str(manifest.get("recipe_digest") or manifest.get("digest", ""))


def current_build(layout: Layout, name: str) -> Path | None:
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
            yield d, read_manifest(d)
        except ImageError:
            continue


def newest_build(layout: Layout, name: str, recipe_digest: str) -> Path | None:
    """The current build of ``name`` if made from ``recipe_digest``, else the newest one."""
    cur = current_build(layout, name)
    if cur is not None and recipe_digest_of(read_manifest(cur)) == recipe_digest:
        return cur
    found = [(m.get("built_at", 0.0), d) for d, m in _builds(layout)
             if m.get("name") == name and recipe_digest_of(m) == recipe_digest]
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


def point_symlink(layout: Layout, name: str, target: Path) -> None:
    """Point ``images/<name>`` at the build ``target`` (a new link renamed over the old),
    relative to a descriptor of ``images`` (a split server owns it). Raises ImageError
    when ``<name>`` is something else than a link, OSError."""
    from hangar.privileged import beneath

    link = layout.image_link(name)
    images = beneath.open_trusted(link.parent)
    try:
        try:
            st = os.stat(link.name, dir_fd=images, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISLNK(st.st_mode):
            raise ImageError(f"{link} exists and is not a symlink", image=name)
        if st is not None and os.readlink(link.name, dir_fd=images) == target.name:
            return
        tmp = f".{name}.link-{os.getpid()}"
        try:
            os.unlink(tmp, dir_fd=images)
        except FileNotFoundError:
            pass
        os.symlink(target.name, tmp, dir_fd=images)
        os.replace(tmp, link.name, src_dir_fd=images, dst_dir_fd=images)
    finally:
        os.close(images)


def ensure_initrd(d: Path, manifest: dict[str, Any],
                   sources: Mapping[str, bytes] | None = None) -> GuestImage:
    paths = ImagePaths(d)
    kver = manifest["kernel"]["version"]
    pyver = manifest.get("python_version")
    own = sources is None
    sources = initramfs.guest_sources() if sources is None else sources
    tag = initramfs.initrd_tag(sources, kver, python_version=pyver)
    initrd = paths.initrd_for(tag)
    if not initrd.is_file():
        from hangar.privileged import beneath

        # the modules tree opened without following a link (a split server's folders)
        top = os.open(d, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            mods = beneath.walk(top, f"{paths.modules.name}/{kver}", directory=True)
        finally:
            os.close(top)
        try:
            initramfs.build_initrd(initrd, modules_dir=Path(beneath.fd_path(mods)),
                                   kernel_version=kver, sources=sources, python_version=pyver)
        finally:
            os.close(mods)
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
        recipe_digest=recipe_digest_of(manifest), vmlinux=vmlinux.recorded(paths, manifest),
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
