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
