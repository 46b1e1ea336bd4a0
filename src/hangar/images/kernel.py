"""Fetching the guest kernel: Debian's cloud kernel, taken from its .deb.

The recipe names a meta-package (``linux-image-cloud-amd64``); ``apt-cache
depends`` resolves it to the versioned package (``linux-image-6.1.0-NN-cloud-
amd64``) that the host's apt lists currently offer, ``apt-get download``
fetches that .deb once into ``<data>/cache/debs`` and ``dpkg-deb -x`` unpacks
it. Nothing is installed on the host.

The image keeps ``vmlinuz`` (a bzImage, which QEMU's ``-kernel`` boots
directly; ``hangar.images.vmlinux`` unpacks the ELF that Firecracker boots
from it) and the full ``lib/modules/<version>`` tree, re-indexed with
``depmod -b``. Debian's cloud kernel builds ext4 in but its virtio drivers
(virtio_mmio, virtio_blk, virtio_console, virtio_net, vsock) as modules, so
``hangar.images.initramfs`` copies those out of this tree.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from hangar.errors import ImageError
from hangar.images.commands import Progress, run
from hangar.images.debian import flock
from hangar.layout import ImagePaths


@dataclass(frozen=True)
class KernelFiles:
    """A kernel unpacked into an image directory."""

    package: str
    """The versioned package, e.g. ``linux-image-6.1.0-56-cloud-amd64``."""
    deb_version: str
    """The Debian version of that package, e.g. ``6.1.192-2``."""
    version: str
    """``uname -r`` of the kernel, e.g. ``6.1.0-56-cloud-amd64``."""
    vmlinuz: Path
    modules: Path
    """``<image>/modules/<version>``, with modules.dep and friends."""


def resolve_package(meta_package: str) -> str:
    """The versioned ``linux-image-*`` package ``meta_package`` depends on."""
    out = run("resolve kernel package", ["apt-cache", "depends", "--important", meta_package])
    for line in out.splitlines():
        m = re.match(r"\s*(?:\|)?Depends:\s*(linux-image-\S+)", line)
        if m and not m.group(1).startswith("<"):
            return m.group(1)
    raise ImageError(
        f"cannot resolve kernel meta-package {meta_package!r} to a versioned package "
        "(is the host's apt index current? try `apt-get update`)",
        step="resolve kernel package", output=out[-2000:],
    )


def download(package: str, debs: Path, progress: Progress | None = None) -> Path:
    """The .deb of ``package`` in ``debs``, downloaded with ``apt-get download`` unless present."""
    debs.mkdir(parents=True, exist_ok=True)
    have = sorted(debs.glob(f"{package}_*.deb"), key=lambda p: p.stat().st_mtime)
    if have and have[-1].name in listed_debs(package, debs):
        return have[-1]
    for p in have:  # not one apt's index lists (an older build, or not Debian's): fetched again
        p.unlink(missing_ok=True)
    if progress:
        progress(f"downloading {package}")
    partial = debs / "partial"
    partial.mkdir(exist_ok=True)
    # Download into a scratch dir, then move: a killed download never looks cached.
    run("download kernel", ["apt-get", "download", "-q", "-o", "APT::Sandbox::User=root", package],
        cwd=partial, timeout=900)
    got = sorted(partial.glob(f"{package}_*.deb"))
    if not got:
        raise ImageError(f"apt-get download {package} produced no .deb", step="download kernel")
    dest = debs / got[-1].name
    got[-1].replace(dest)
    shutil.rmtree(partial, ignore_errors=True)
    return dest


def listed_debs(package: str, debs: Path) -> set[str]:
    """Names of the .debs in ``debs`` whose SHA-256 is one that the host's apt index (signed
    by Debian) lists for ``package``: a cached kernel is used only when it is Debian's
    (an earlier Hangar handed the cache to a split server's user, who could write it)."""
    out = run("kernel checksums", ["apt-cache", "show", package])
    sums = {ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("SHA256:")}
    found: set[str] = set()
    for p in debs.glob(f"{package}_*.deb"):
        h = hashlib.sha256()
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        if h.hexdigest() in sums:
            found.add(p.name)
    return found


def unpack(deb: Path, work: Path, image_dir: Path) -> KernelFiles:
    """Unpack ``deb`` under ``work`` and move vmlinuz and the modules tree into ``image_dir``."""
    x = work / "kernel-deb"
    run("unpack kernel", ["dpkg-deb", "-x", deb, x])
    vmlinuzes = sorted((x / "boot").glob("vmlinuz-*"))
    if len(vmlinuzes) != 1:
        raise ImageError(f"{deb.name}: expected one boot/vmlinuz-*, found {len(vmlinuzes)}",
                         step="unpack kernel")
    version = vmlinuzes[0].name.removeprefix("vmlinuz-")
    # bookworm ships /lib/modules; later suites ship /usr/lib/modules.
    for lib in ("lib", "usr/lib"):
        if (x / lib / "modules" / version).is_dir():
            break
    else:
        raise ImageError(f"{deb.name}: no modules tree for {version}", step="unpack kernel")
    # depmod -b BASE indexes BASE/lib/modules/<version>.
    run("depmod", ["depmod", "-b", x if lib == "lib" else x / "usr", version])
    paths = ImagePaths(image_dir)
    vmlinuz = paths.kernel
    shutil.copyfile(vmlinuzes[0], vmlinuz)
    modules = paths.modules / version
    modules.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(x / lib / "modules" / version), str(modules))
    deb_version = deb.name.split("_")[1] if deb.name.count("_") >= 2 else ""
    return KernelFiles(
        package=deb.name.split("_")[0], deb_version=deb_version, version=version,
        vmlinuz=vmlinuz, modules=modules,
    )


def fetch(meta_package: str, debs: Path, work: Path, image_dir: Path,
          progress: Progress | None = None, lock: Path | None = None) -> KernelFiles:
    """Resolve, download (cached in ``debs``) and unpack the kernel into ``image_dir``.

    With ``lock`` (the flock file of ``hangar.images.debian.debootstrap``), builds side by
    side take turns at the download: they share ``debs`` and its scratch folder."""
    package = resolve_package(meta_package)
    if progress:
        progress(f"kernel: {package}")
    with flock(lock):
        deb = download(package, debs, progress)
    return unpack(deb, work, image_dir)
