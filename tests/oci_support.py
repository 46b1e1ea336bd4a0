"""Small OCI images made by tests, without docker: a busybox root filesystem, written as
a ``docker save`` tarball (the format ``hangar template import`` reads most often)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

BUSYBOX = "/bin/busybox"  # busybox-static: runs in a tree with no C library at all


def busybox_rootfs(root: Path, files: dict[str, str] | None = None) -> None:
    """A tree with only a static busybox and its applets in /bin, and ``files``."""
    (root / "bin").mkdir(parents=True)
    shutil.copy2(BUSYBOX, root / "bin" / "busybox")
    applets = subprocess.run([BUSYBOX, "--list"], capture_output=True, text=True,
                             check=True).stdout.split()
    for applet in applets:
        if applet != "busybox":
            os.symlink("busybox", root / "bin" / applet)
    for path, text in (files or {}).items():
        dest = root / path.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text)


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def docker_archive(root: Path, out: Path, *, env: list[str], cmd: list[str],
                   workdir: str = "/") -> None:
    """Write ``root`` as a one-layer image in ``docker save``'s format to ``out``."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        t.add(root, arcname=".")
    layer = buf.getvalue()
    layer_sha = hashlib.sha256(layer).hexdigest()
    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Env": env, "Cmd": cmd, "WorkingDir": workdir},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer_sha}"]},
    }).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    manifest = json.dumps([{"Config": config_name, "RepoTags": ["tiny:latest"],
                            "Layers": [f"{layer_sha}/layer.tar"]}]).encode()
    with tarfile.open(out, "w") as t:
        _add(t, "manifest.json", manifest)
        _add(t, config_name, config)
        _add(t, f"{layer_sha}/layer.tar", layer)


def layer(entries: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    """A plain tar layer of ``entries`` exactly as given (names, types, links, modes):
    nothing is normalized, so a test can write what a hostile image would."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for info, data in entries:
            t.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def member(name: str, kind: bytes = tarfile.REGTYPE, *, data: bytes = b"", link: str = "",
           mode: int = 0o644) -> tuple[tarfile.TarInfo, bytes | None]:
    """One entry for ``layer``: a file (``data``), folder, symlink or hard link (``link``),
    device or FIFO."""
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.linkname = link
    if kind == tarfile.REGTYPE:
        info.size = len(data)
        return info, data
    if kind in (tarfile.CHRTYPE, tarfile.BLKTYPE):
        info.devmajor, info.devminor = 8, 0
    return info, None


def tree_layer(root: Path) -> bytes:
    """A layer of the folder ``root`` as tar writes it."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        t.add(root, arcname=".")
    return buf.getvalue()


def oci_archive(out: Path, layers: list[bytes], *, env: list[str] | None = None,
                cmd: list[str] | None = None) -> None:
    """Write an OCI image layout tarball (``oci-layout``, ``index.json``, ``blobs/``) of
    ``layers`` (plain tar) to ``out``, tagged ``latest``."""
    blobs: dict[str, bytes] = {}

    def blob(data: bytes) -> dict[str, object]:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return {"digest": digest, "size": len(data)}

    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Env": env or ["PATH=/bin"], "Cmd": cmd or ["/bin/sh"]},
        "rootfs": {"type": "layers", "diff_ids": [
            "sha256:" + hashlib.sha256(x).hexdigest() for x in layers]},
    }).encode()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **blob(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", **blob(x)}
                   for x in layers],
    }).encode()
    index = json.dumps({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", **blob(manifest),
        "annotations": {"org.opencontainers.image.ref.name": "latest"}}]}).encode()
    with tarfile.open(out, "w") as t:
        _add(t, "oci-layout", b'{"imageLayoutVersion": "1.0.0"}')
        _add(t, "index.json", index)
        for digest, data in blobs.items():
            _add(t, "blobs/sha256/" + digest.split(":", 1)[1], data)
