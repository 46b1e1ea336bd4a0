"""What an OCI image's layers may hold before Hangar unpacks them as root.

``check_layers`` reads every layer of the image (as ``skopeo`` wrote it into
an OCI layout) with ``tarfile``, in order, without writing anything, and
refuses the image (``InvalidRequest`` naming the layer and member) when a
member is

* a character or block **device** (an image has no use for one: the guest's
  /dev is made at boot);
* at an **absolute** path or one with a **``..``** component;
* a **symlink whose relative target climbs above the root** (``a/b -> ../../x``);
  absolute targets (``/etc/localtime -> /usr/share/zoneinfo/UTC``) are kept as
  they are: they name a path in the guest, and no host operation follows them
  (``hangar.images.safetree``);
* a **hard link** to anything but a file or link an earlier member made (not
  absolute, no ``..``, nothing outside the tree);
* under a path that an earlier member made a **symlink** (``etc -> /etc`` then
  ``etc/passwd``: the classic write through a link), in this layer or a lower
  one (whiteouts lift it);

and when the image passes the bounds: ``MAX_LAYERS`` layers,
``MAX_MEMBERS`` members, ``MAX_BYTES`` of files, ``MAX_PATH`` bytes of a
path or link target. Set-user-ID and set-group-ID bits are kept: they act
in the guest only (the tree stays in a root-only folder of the host while
it is built, and build steps run in a user namespace, where they give no
host privilege).

Layers may be plain or gzip tarballs; others (zstd) are refused with a hint.
"""

from __future__ import annotations

import json
import posixpath
import tarfile
from pathlib import Path
from typing import Any

from hangar.errors import ImageError, InvalidRequest

MAX_LAYERS = 128
MAX_MEMBERS = 1_000_000
MAX_BYTES = 16 << 30
"""File bytes of all layers together (uncompressed)."""
MAX_ARCHIVE_BYTES = 32 << 30
"""Largest archive file read (its layers may be stored uncompressed, with metadata)."""
MAX_PATH = 4096
MAX_NAME = 255
MAX_WHITEOUT_WORK = 50_000_000
"""Links looked at by whiteouts, all layers together (each whiteout looks at every link
known so far): bounds the time a pathological image costs."""
MAX_JSON = 4 << 20
"""Largest index, manifest or config blob read, bytes."""
LAYER_TYPES = {
    "application/vnd.oci.image.layer.v1.tar": "r|",
    "application/vnd.oci.image.layer.v1.tar+gzip": "r|gz",
    "application/vnd.docker.image.rootfs.diff.tar": "r|",
    "application/vnd.docker.image.rootfs.diff.tar.gzip": "r|gz",
}
WHITEOUT = ".wh."


def blob_path(layout: Path, digest: str) -> Path:
    """The file of blob ``digest`` (``sha256:<hex>``) in ``layout``; ImageError otherwise."""
    algo, _, hexdigest = str(digest).partition(":")
    if algo != "sha256" or len(hexdigest) != 64 or not all(
            c in "0123456789abcdef" for c in hexdigest):
        raise ImageError(f"unexpected blob digest {str(digest)[:80]!r} in the image")
    return layout / "blobs" / algo / hexdigest


def read_json(path: Path) -> Any:
    """A JSON document of at most ``MAX_JSON`` bytes. Raises ImageError."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_JSON + 1)
    except OSError as exc:
        raise ImageError(f"cannot read {path.name} of the image: {exc.strerror}") from None
    if len(raw) > MAX_JSON:
        raise InvalidRequest(f"the image's {path.name} is larger than {MAX_JSON} bytes")
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise ImageError(f"{path.name} of the image is not JSON: {exc}") from None


def manifest(layout: Path, tag: str) -> dict[str, Any]:
    """The manifest of the image tagged ``tag`` in ``layout``. Raises ImageError."""
    index = read_json(layout / "index.json")
    try:
        entry = next(m for m in index.get("manifests", [])
                     if m.get("annotations", {}).get("org.opencontainers.image.ref.name")
                     == tag)
        found = read_json(blob_path(layout, entry["digest"]))
    except (AttributeError, KeyError, StopIteration, TypeError):
        raise ImageError(f"the OCI layout names no image {tag!r}") from None
    if not isinstance(found, dict):
        raise ImageError("the image's manifest is not an object")
    return found


class _Scan:
    """State carried from layer to layer: the links and entries made so far, each with
    the layer that made it (a whiteout lifts only what lower layers made)."""

    def __init__(self) -> None:
        self.layer = 0
        self.symlinks: dict[str, int] = {}
        self.entries: dict[str, tuple[bool, int]] = {}
        """Every non-folder path made so far -> (can be hard-linked to, layer)."""
        self.members = 0
        self.bytes = 0
        self.work = 0

    def refuse(self, where: str, name: str, why: str) -> InvalidRequest:
        return InvalidRequest(f"the image is refused: {where}: {name[:200]!r} {why}",
                              member=name[:200])

    def norm(self, where: str, name: str, what: str = "") -> str:
        if len(name.encode()) > MAX_PATH:
            raise self.refuse(where, name, f"is longer than {MAX_PATH} bytes")
        if name.startswith("/"):
            raise self.refuse(where, name, f"{what}is an absolute path")
        parts = [p for p in name.split("/") if p not in ("", ".")]
        if ".." in parts:
            raise self.refuse(where, name, f"{what}has a '..' component")
        if any(len(p.encode()) > MAX_NAME for p in parts):
            raise self.refuse(where, name, f"has a name longer than {MAX_NAME} bytes")
        return "/".join(parts)

    def through_link(self, path: str) -> str | None:
        parts = path.split("/")
        for i in range(1, len(parts)):
            prefix = "/".join(parts[:i])
            if prefix in self.symlinks:
                return prefix
        return None

    def replace(self, path: str) -> None:
        """A new member at ``path``: what was there is gone. Links below a folder it
        replaces stay known (members under them are then refused: the safe side)."""
        self.symlinks.pop(path, None)
        self.entries.pop(path, None)

    def whiteout(self, path: str, *, itself: bool = True) -> None:
        """A lower layer's ``path`` (with ``itself``) and the links below it are gone."""
        below = path + "/" if path else ""
        self.work += len(self.symlinks)
        if self.work > MAX_WHITEOUT_WORK:
            raise InvalidRequest("the image is refused: too many whiteouts over too many "
                                 "symbolic links")
        self.symlinks = {p: n for p, n in self.symlinks.items()
                         if n == self.layer or not ((itself and p == path)
                                                    or p.startswith(below))}
        if itself and self.entries.get(path, (False, self.layer))[1] < self.layer:
            del self.entries[path]

    def member(self, where: str, m: tarfile.TarInfo) -> None:
        self.members += 1
        if self.members > MAX_MEMBERS:
            raise InvalidRequest(f"the image is refused: more than {MAX_MEMBERS} files")
        path = self.norm(where, m.name)
        if not path:
            return  # the root folder itself
        link = self.through_link(path)
        if link is not None:
            raise self.refuse(where, m.name, f"is under {link!r}, which an earlier member "
                                             "made a symbolic link")
        if m.ischr() or m.isblk():
            raise self.refuse(where, m.name, "is a device node")
        base = posixpath.basename(path)
        if base.startswith(WHITEOUT):
            folder = posixpath.dirname(path)
            if base == WHITEOUT + WHITEOUT + ".opq":
                self.whiteout(folder, itself=False)
            else:
                self.whiteout(posixpath.join(folder, base[len(WHITEOUT):]))
            return
        if m.issym():
            target = m.linkname
            if len(target.encode()) > MAX_PATH or "\0" in target:
                raise self.refuse(where, m.name, f"links to a target longer than {MAX_PATH}")
            if not target.startswith("/"):
                depth = path.count("/")
                for p in target.split("/"):
                    depth += -1 if p == ".." else (0 if p in ("", ".") else 1)
                    if depth < 0:
                        raise self.refuse(where, m.name, f"links to {target[:200]!r}, "
                                                         "above the image's root")
            self.replace(path)
            self.symlinks[path] = self.layer
            self.entries[path] = (True, self.layer)
            return
        if m.islnk():
            target = self.norm(where, m.linkname, "is a hard link whose target ")
            if not self.entries.get(target, (False, 0))[0] or self.through_link(target):
                raise self.refuse(where, m.name, f"is a hard link to {m.linkname[:200]!r}, "
                                                 "which no earlier member made a file")
            self.replace(path)
            self.entries[path] = (True, self.layer)
            return
        if m.isdir():
            # a folder over a link: kept as a link here (members below it are refused)
            self.entries.pop(path, None) if path not in self.symlinks else None
            return
        if not (m.isreg() or m.isfifo()):
            raise self.refuse(where, m.name, f"has an unknown type {m.type!r}")
        self.bytes += max(m.size, 0)
        if self.bytes > MAX_BYTES:
            raise InvalidRequest(f"the image is refused: its files exceed {MAX_BYTES} bytes")
        self.replace(path)
        self.entries[path] = (m.isreg(), self.layer)


def check_layers(layout: Path, tag: str) -> int:
    """Read every layer of image ``tag`` in the OCI ``layout``; return the member count.

    Raises InvalidRequest (what the image holds is refused, see the module) or
    ImageError (the layout is unreadable).
    """
    layers = manifest(layout, tag).get("layers")
    if not isinstance(layers, list):
        raise ImageError("the image's manifest lists no layers")
    if len(layers) > MAX_LAYERS:
        raise InvalidRequest(f"the image is refused: {len(layers)} layers, more than "
                             f"{MAX_LAYERS}")
    scan = _Scan()
    for i, layer in enumerate(layers, 1):
        if not isinstance(layer, dict):
            raise ImageError("a layer of the image's manifest is not an object")
        mode = LAYER_TYPES.get(str(layer.get("mediaType")))
        if mode is None:
            raise InvalidRequest(f"layer {i} of the image is {layer.get('mediaType')!r}; "
                                 "Hangar reads plain and gzip layers (re-save the image "
                                 "with gzip compression)")
        where = f"layer {i}"
        scan.layer = i
        try:
            with tarfile.open(blob_path(layout, layer.get("digest", "")), mode) as tar:
                for m in tar:
                    scan.member(where, m)
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise InvalidRequest(f"the image is refused: {where} is not a readable tar "
                                 f"archive: {exc}") from None
    return scan.members
