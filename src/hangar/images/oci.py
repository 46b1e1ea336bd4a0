"""OCI images from local archives: unpacked into a tree a template is built on.

Accepted (a path on this host; nothing is pulled from a registry):

* a ``docker save`` tarball (``manifest.json`` at its top),
* an OCI image layout tarball (``oci-layout`` at its top),
* an OCI image layout folder (``oci-layout``, ``index.json``, ``blobs/``).

``skopeo copy`` (Debian's ``skopeo``) normalizes any of them into an OCI
layout in the build's scratch folder, and ``umoci unpack`` (Debian's
``umoci``) applies the layers into a root filesystem, with ownership,
modes, whiteouts and links handled by it. The image's environment,
command and working directory come from its config blob. The archive
must hold one image (for several, name the one to take in a layout folder
as ``folder:tag``). Signature policy does not apply to local archives, so
skopeo runs with ``--insecure-policy`` (it would otherwise need
/etc/containers/policy.json).
"""

from __future__ import annotations

import hashlib
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hangar.errors import ImageError, InvalidRequest
from hangar.images import oci_check
from hangar.images.commands import Progress, require_tools, run

TAG = "hangar"


@dataclass(frozen=True)
class OciImage:
    """An unpacked image: its root filesystem and what its config says."""

    rootfs: Path
    env: dict[str, str] = field(default_factory=dict)
    command: list[str] = field(default_factory=list)
    """Entrypoint and Cmd together (recorded; a template's ``start`` is what runs)."""
    workdir: str = "/"


def _split(spec: Path) -> tuple[Path, str | None]:
    """A layout folder may be given as ``folder:tag``."""
    text = str(spec)
    if not spec.exists() and ":" in text:
        folder, _, tag = text.rpartition(":")
        return Path(folder), tag
    return spec, None


def source(spec: Path) -> str:
    """The skopeo transport reference for an archive or layout folder.

    Raises InvalidRequest for a path that is none of the accepted forms.
    """
    path, tag = _split(spec)
    if path.is_dir():
        if not (path / "oci-layout").is_file():
            raise InvalidRequest(f"{path} is a folder without an oci-layout file; give a "
                                 "`docker save` tarball or an OCI image layout")
        return f"oci:{path}" + (f":{tag}" if tag else "")
    if not path.is_file():
        raise InvalidRequest(f"{path} does not exist")
    try:
        names: set[str] = set()
        with tarfile.open(path) as tar:
            for i, m in enumerate(tar):  # the top of a layout or docker save: a few names
                if i >= 10000:
                    break
                names.add(m.name.lstrip("./"))
    except (tarfile.TarError, OSError) as exc:
        raise InvalidRequest(f"{path} is not a tar archive: {exc}") from None
    if "oci-layout" in names:
        return f"oci-archive:{path}"
    if "manifest.json" in names:
        return f"docker-archive:{path}"
    raise InvalidRequest(f"{path} holds neither manifest.json (docker save) nor oci-layout "
                         "(an OCI image layout)")


def archive_digest(spec: Path) -> str:
    """SHA-256 naming the image's content: of the archive's bytes, or of a layout
    folder's index.json (which names every blob by its digest)."""
    path, tag = _split(spec)
    h = hashlib.sha256()
    if path.is_dir():
        h.update((path / "index.json").read_bytes() + f"\0{tag or ''}".encode())
        return h.hexdigest()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def unpack(spec: Path, work: Path, say: Progress) -> OciImage:
    """Unpack the image at ``spec`` under ``work``; returns its tree and config.

    Raises InvalidRequest for an archive that is not an image, ImageError
    when skopeo or umoci fail (with their output).
    """
    require_tools("skopeo", "umoci")
    ref = source(spec)
    layout = work / "oci"
    bundle = work / "bundle"
    path, _tag = _split(spec)
    if path.is_file() and path.stat().st_size > oci_check.MAX_ARCHIVE_BYTES:
        raise InvalidRequest(f"{path} is larger than {oci_check.MAX_ARCHIVE_BYTES} bytes")
    say(f"reading {ref.split(':', 1)[0]} {spec}")
    run("skopeo copy", ["skopeo", "--insecure-policy", "copy", "--quiet", ref,
                        f"oci:{layout}:{TAG}"], progress=say, echo=lambda ln: True,
        timeout=1800)
    members = oci_check.check_layers(layout, TAG)
    say(f"checked {members} files of the image: no devices, no links or paths out of it")
    say("unpacking the layers (umoci)")
    run("umoci unpack", ["umoci", "unpack", "--image", f"{layout}:{TAG}", str(bundle)],
        timeout=1800)
    image_config = _image_config(layout)
    env: dict[str, str] = {}
    for item in _strings(image_config.get("Env")):
        name, sep, value = item.partition("=")
        if sep and name and "\0" not in item:
            env[name] = value
    args = _strings(image_config.get("Entrypoint")) + _strings(image_config.get("Cmd"))
    return OciImage(bundle / "rootfs", env, args, str(image_config.get("WorkingDir") or "/"))


def _strings(value: Any) -> list[str]:
    """A config field that should be a list of strings (anything else reads as empty)."""
    return [str(v) for v in value] if isinstance(value, list) else []


def _image_config(layout: Path) -> dict[str, Any]:
    """The ``config`` object of the image tagged ``TAG`` in the layout skopeo wrote
    (Env, Entrypoint, Cmd, WorkingDir...; the OCI image spec's config)."""
    try:
        config = oci_check.read_json(oci_check.blob_path(
            layout, oci_check.manifest(layout, TAG)["config"]["digest"]))
    except (KeyError, TypeError) as exc:
        raise ImageError(f"cannot read the image's config from the OCI layout: {exc!r}") \
            from None
    inner = config.get("config") if isinstance(config, dict) else None
    return inner if isinstance(inner, dict) else {}
