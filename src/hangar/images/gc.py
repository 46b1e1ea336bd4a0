"""Removing image builds that nothing uses any more (``hangar image gc``).

A forced rebuild leaves the old build in place (builds are immutable, see
``hangar.images.builder``); ``collect`` removes the builds (of recipes and
templates alike) that are

- not the current build of their recipe or template (the ``<name>`` symlink's target),
  except for an image pulled from a registry for a build (``reg-*``: its name goes too),
- not pinned: no sandbox, snapshot or machine record names them (the
  caller passes those ids, read from the store of the data directory),
- not in use on this host: no process holds one of their files open (a
  running QEMU keeps its disk's backing rootfs open) and no file of theirs
  has another hard link (Firecracker links the image's files into each
  sandbox's directory).

The last rule also protects VMs of other data directories that share one
image cache, whose records the caller cannot see; their snapshots and
sleeping machines are not protected by it, so ``collect`` refuses to work
on an ``images`` folder that is a symlink to someone else's cache.

Each recipe is handled under its build lock (``catalogue.image_lock``), so no
build of it can pick a build as current while it is being removed. A build
is first renamed to ``.trash-<id>-<pid>`` and then deleted, so a crash never
leaves half a build under a real id; leftovers of interrupted builds and
collections (``.staging-*``, ``.trash-*``) are removed too. Every rename and
removal is relative to a descriptor of ``images`` opened without following a
link, and a tree is removed through descriptors (``staging.remove_at``:
``beneath.remove_tree``, which opens each folder with ``O_DIRECTORY |
O_NOFOLLOW | O_NONBLOCK`` relative to its parent), so root collecting beside a split server, whose
user owns ``images``, never removes through a symlink the server put there.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from hangar.errors import ImageError
from hangar.images import staging
from hangar.images.catalogue import ImageInfo, image_lock, list_images
from hangar.images.recipes import RECIPES
from hangar.images.registry import PULLED_PREFIX
from hangar.layout import TRASH_PREFIX, ImagePaths, Layout


@dataclass(frozen=True)
class Kept:
    """A build that stays, and why: ``current``, ``pinned`` or ``in use``."""

    image: ImageInfo
    reason: str


@dataclass
class Collection:
    """What ``collect`` removed (or, in a dry run, would remove)."""

    dry_run: bool
    removed: list[ImageInfo] = field(default_factory=list)
    kept: list[Kept] = field(default_factory=list)
    leftovers: list[Path] = field(default_factory=list)
    """Staging and trash directories of interrupted builds and collections."""

    @property
    def freed_bytes(self) -> int:
        """Allocated bytes of the removed builds."""
        return sum(i.bytes_on_disk for i in self.removed)


def open_inodes() -> set[tuple[int, int]]:
    """(device, inode) of every file some process on this host has open (``/proc/*/fd``).

    Processes whose descriptors this user may not read are skipped.
    """
    found: set[tuple[int, int]] = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fds = list((d / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                st = os.stat(fd)
            except OSError:
                continue
            found.add((st.st_dev, st.st_ino))
    return found


def in_use(build: Path, opened: set[tuple[int, int]]) -> bool:
    """Whether a file of ``build`` is open (``opened``) or hard-linked elsewhere."""
    paths = ImagePaths(build)
    for f in (paths.rootfs, paths.kernel, paths.vmlinux, *build.glob("initrd-*.img")):
        try:
            st = os.lstat(f)
        except OSError:
            continue
        if st.st_nlink > 1 or (st.st_dev, st.st_ino) in opened:
            return True
    return False


def collect(layout: Layout, pinned: Iterable[str], *, dry_run: bool = False,
            only: Iterable[str] | None = None) -> Collection:
    """Remove every build that is not current, not pinned and not in use; see the module doc.

    ``pinned`` holds image ids (``<name>-<digest>``); a bare recipe name
    pins every build of it (a record that does not say which build it used).
    With ``dry_run`` nothing is removed; ``only`` limits the work to builds of
    those recipe or template names. Raises ``ImageError`` when
    ``layout.images`` is a symlink (a shared cache) or a removal fails.
    """
    if layout.images.is_symlink():
        raise ImageError(f"{layout.images} is a symlink to an image cache that other data "
                         "directories may share; collect it from the data directory that "
                         "owns it", images=str(layout.images))
    pins = set(pinned)
    result = Collection(dry_run)
    if not layout.images.is_dir():
        return result
    images = staging.open_images(layout)  # every removal below goes through it
    try:
        names = sorted({i.name for i in list_images(layout)} | set(RECIPES))
        if only is not None:
            names = [n for n in names if n in set(only)]
        for name in names:
            with image_lock(layout, name):
                opened = open_inodes()
                for info in list_images(layout):
                    if info.name != name:
                        continue
                    if info.current and not name.startswith(PULLED_PREFIX):
                        result.kept.append(Kept(info, "current"))
                    elif info.id in pins or info.name in pins:
                        result.kept.append(Kept(info, "pinned"))
                    elif in_use(info.dir, opened):
                        result.kept.append(Kept(info, "in use"))
                    else:
                        result.removed.append(info)
                        if not dry_run:
                            trash = layout.image_trash(info.id).name
                            os.rename(info.id, trash, src_dir_fd=images, dst_dir_fd=images)
                            _remove(images, trash)
                            if info.current:  # a pulled image's name goes with its build
                                os.unlink(name, dir_fd=images)
                for leftover in _named(images, layout.image_staging_prefix(name)):
                    result.leftovers.append(layout.images / leftover)
                    if not dry_run:
                        _remove(images, leftover)
        for leftover in (_named(images, TRASH_PREFIX) if only is None else ()):
            result.leftovers.append(layout.images / leftover)
            if not dry_run:
                _remove(images, leftover)
    finally:
        os.close(images)
    return result


def _named(images: int, prefix: str) -> list[str]:
    """Names in the folder ``images`` that start with ``prefix``."""
    return sorted(n for n in os.listdir(images) if n.startswith(prefix))


def _remove(images: int, name: str) -> None:
    """``name`` of ``images`` and everything in it, through descriptors
    (``staging.remove_at``: a symlink there is unlinked, never followed). Raises
    ImageError."""
    try:
        staging.remove_at(images, name)
    except OSError as exc:
        raise ImageError(f"cannot remove {name}: {exc}", image=name) from exc
