"""The kernel as an ELF ``vmlinux``, unpacked from Debian's bzImage at build time.

Firecracker on x86_64 boots only an uncompressed ELF kernel, while Debian
ships a bzImage (``vmlinuz``, which QEMU boots). The builder unpacks the ELF
once per image into ``vmlinux`` beside it and records it in the manifest
(``kernel.vmlinux``: file, compression, bytes). Builds made before that
get it on first use (``ensure_vmlinux``, about 0.3 s), recorded the same way.

``extract_vmlinux`` reads the payload's offset and length from the x86 boot
header (boot protocol 2.08+, ``Documentation/arch/x86/boot.rst`` of the
kernel); the kernel build appends the decompressed size to every payload
except gzip's, which is checked. Without a usable header it scans for
compressed streams until one decompresses to an x86_64 ELF.
"""

from __future__ import annotations

import bz2
import errno
import json
import logging
import lzma
import os
import shutil
import struct
import subprocess
import threading
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hangar.errors import ImageError
from hangar.layout import ImagePaths
from hangar.privileged import beneath

if TYPE_CHECKING:
    from hangar.images.guest_image import GuestImage

log = logging.getLogger("hangar.images.vmlinux")

_MAGICS: tuple[tuple[bytes, str], ...] = (
    (b"\x1f\x8b", "gzip"),
    (b"\xfd7zXZ\x00", "xz"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
    (b"\x02\x21\x4c\x18", "lz4"),
    (b"BZh", "bzip2"),
    (b"\x89LZO", "lzo"),
    (b"\x5d\x00\x00", "lzma"),
)
_TOOLS = {"zstd": ["zstd", "-dcq"], "lz4": ["lz4", "-dcq"], "lzo": ["lzop", "-dcq"]}


def is_x86_64_elf(data: bytes) -> bool:
    """Whether ``data`` starts with the header of a 64-bit x86_64 ELF file."""
    return (len(data) > 20 and data[:4] == b"\x7fELF" and data[4] == 2
            and struct.unpack_from("<H", data, 18)[0] == 0x3E)


def _decompress(fmt: str, payload: bytes) -> bytes:
    """Decompress one kernel payload; trailing bytes after the stream are ignored."""
    if fmt == "gzip":
        return zlib.decompressobj(wbits=31).decompress(payload)
    if fmt == "xz":
        return lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(payload)
    if fmt == "lzma":
        return lzma.LZMADecompressor(format=lzma.FORMAT_ALONE).decompress(payload)
    if fmt == "bzip2":
        return bz2.BZ2Decompressor().decompress(payload)
    tool = _TOOLS[fmt]
    if shutil.which(tool[0]) is None:
        raise ImageError(f"the kernel is {fmt}-compressed and {tool[0]} is not installed "
                         f"(Debian package {'lzop' if fmt == 'lzo' else tool[0]})")
    out = subprocess.run(tool, input=payload, capture_output=True, check=False)
    if out.returncode != 0 and not out.stdout:
        raise ImageError(f"{tool[0]} failed: {out.stderr.decode(errors='replace').strip()}")
    return out.stdout


def extract_vmlinux(bzimage: bytes) -> tuple[bytes, str]:
    """The ELF kernel inside a bzImage, and the compression it was found in.

    Raises ImageError when no x86_64 ELF comes out.
    """
    if is_x86_64_elf(bzimage):
        return bzimage, "none"
    if len(bzimage) > 0x250 and bzimage[0x202:0x206] == b"HdrS" \
            and struct.unpack_from("<H", bzimage, 0x206)[0] >= 0x208:
        setup = ((bzimage[0x1F1] or 4) + 1) * 512
        offset, length = struct.unpack_from("<II", bzimage, 0x248)
        payload = bzimage[setup + offset:setup + offset + length]
        for magic, fmt in _MAGICS:
            if payload.startswith(magic):
                if fmt == "gzip":
                    data = _decompress(fmt, payload)
                else:
                    (size,) = struct.unpack("<I", payload[-4:])
                    data = _decompress(fmt, payload[:-4])
                    if len(data) != size:
                        raise ImageError(f"{fmt} kernel payload gave {len(data)} bytes, "
                                         f"its trailer says {size}")
                if is_x86_64_elf(data):
                    return data, fmt
                raise ImageError(f"the {fmt} payload of the bzImage is not an x86_64 ELF")
    for magic, fmt in _MAGICS:
        start = 0
        for _ in range(16):
            i = bzimage.find(magic, start)
            if i < 0:
                break
            start = i + 1
            try:
                data = _decompress(fmt, bzimage[i:])
            except (ImageError, OSError, EOFError, ValueError, zlib.error, lzma.LZMAError):
                continue
            if is_x86_64_elf(data):
                return data, fmt
    raise ImageError("no compressed x86_64 ELF kernel found in the bzImage")


KERNEL_MAX = 256 << 20
"""Bytes of a ``vmlinuz`` that ``write_vmlinux`` reads (Debian's are about 8 MiB)."""
MANIFEST_MAX = 1 << 20
"""Bytes of a ``manifest.json`` that ``ensure_vmlinux`` reads."""


def _read_at(dir_fd: int, name: str, max_bytes: int) -> bytes:
    """The regular file ``name`` of the folder ``dir_fd``, opened without following a
    symlink (a FIFO put there cannot hang the reader). Raises OSError (EFBIG: larger
    than ``max_bytes``)."""
    with beneath.walked(dir_fd, name) as fd:
        os.set_blocking(fd, True)
        data = os.read(fd, max_bytes + 1)
        while len(data) <= max_bytes:
            more = os.read(fd, max_bytes + 1 - len(data))
            if not more:
                break
            data += more
    if len(data) > max_bytes:
        raise OSError(errno.EFBIG, f"{name} is larger than {max_bytes} bytes")
    return data


def write_vmlinux(paths: ImagePaths, dir_fd: int | None = None) -> dict[str, Any]:
    """Unpack ``paths.kernel`` into ``paths.vmlinux`` (atomically); returns its manifest record.

    The record is ``{"file": "vmlinux", "compression": ..., "bytes": ...}``.
    Every act is relative to a descriptor of the folder (``dir_fd``, else
    ``paths.dir`` opened here by ``beneath.open_trusted``): the kernel is read
    without following a symlink, and ``vmlinux`` is a new file of this process's
    own, mode 0644 set through its descriptor, renamed over the name. So a root
    caller changes nothing through a name the folder's owner (a split server)
    swapped. Takes about 0.3 s. Raises ImageError.
    """
    try:
        fd = beneath.open_trusted(paths.dir) if dir_fd is None else dir_fd
    except OSError as e:
        raise ImageError(f"cannot open the image folder {paths.dir}: {e}", image=paths.id) from e
    try:
        try:
            bzimage = _read_at(fd, paths.kernel.name, KERNEL_MAX)
        except OSError as e:
            raise ImageError(f"cannot read the kernel {paths.kernel}: {e}",
                             image=paths.id) from e
        data, fmt = extract_vmlinux(bzimage)
        try:
            beneath.write_at(fd, paths.vmlinux.name, data, 0o644)
        except OSError as e:
            raise ImageError(f"cannot write {paths.vmlinux}: {e}", image=paths.id) from e
    finally:
        if dir_fd is None:
            os.close(fd)
    log.info("unpacked %s (%s, %d bytes) into %s", paths.kernel, fmt, len(data), paths.vmlinux)
    return {"file": paths.vmlinux.name, "compression": fmt, "bytes": len(data)}


def recorded(paths: ImagePaths, manifest: dict[str, Any]) -> Path | None:
    """``paths.vmlinux`` when the manifest records it and the file has the recorded size."""
    rec = manifest.get("kernel", {}).get("vmlinux")
    if not isinstance(rec, dict):
        return None
    try:
        if paths.vmlinux.stat().st_size == rec.get("bytes"):
            return paths.vmlinux
    except OSError:
        pass
    return None


_lock = threading.Lock()


def ensure_vmlinux(image: "GuestImage") -> Path:
    """The image's ``vmlinux``; for a build that lacks one, unpacked now and recorded.

    Fast (a stat) when the manifest records it. Otherwise unpacks the kernel
    (about 0.3 s) and adds ``kernel.vmlinux`` to manifest.json, each written
    atomically, so concurrent callers at worst unpack twice. Raises ImageError.
    """
    paths = ImagePaths(image.dir)
    if image.vmlinux is not None and image.vmlinux.is_file():
        return image.vmlinux
    with _lock:
        try:  # every act below relative to the folder as opened here (write_vmlinux)
            dir_fd = beneath.open_trusted(paths.dir)
        except OSError as e:
            raise ImageError(f"cannot open the image folder {paths.dir}: {e}",
                             image=paths.id) from e
        try:
            try:
                manifest = json.loads(_read_at(dir_fd, paths.manifest.name, MANIFEST_MAX))
                if not isinstance(manifest, dict):
                    raise ValueError("not a JSON object")
            except (OSError, ValueError) as e:
                raise ImageError(f"image {paths.id}: unreadable manifest.json: {e}",
                                 image=paths.id) from e
            found = recorded(paths, manifest)
            if found is not None:
                return found
            manifest.setdefault("kernel", {})["vmlinux"] = write_vmlinux(paths, dir_fd)
            try:
                beneath.write_at(dir_fd, paths.manifest.name,
                                 (json.dumps(manifest, indent=2) + "\n").encode(), 0o644)
            except OSError as e:
                raise ImageError(f"cannot write {paths.manifest}: {e}", image=paths.id) from e
        finally:
            os.close(dir_fd)
        return paths.vmlinux
