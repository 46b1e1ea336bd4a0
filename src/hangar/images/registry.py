"""Images pulled from an OCI registry: references, the operator's policy, ``skopeo``.

A template built through E2B's API may start ``FROM`` an image of a registry
(the SDK's ``from_image(ref)``, ``from_ubuntu_image``, ..., a Dockerfile's
``FROM``). ``pull`` copies it with Debian's ``skopeo`` into an OCI image
layout folder, which ``hangar.images.template_builder`` then checks, unpacks
and packs like any OCI archive (``hangar.images.oci``). This runs as root,
in ``python -m hangar.images.pull`` (the root helper starts it for a split
server: ``hangar.roothelper``); the unprivileged server never holds a
registry's credentials.

References follow the distribution project's grammar: ``[host[:port]/]path
[:tag][@sha256:digest]``; a first component with no ``.`` or ``:`` (and not
``localhost``) is a path of Docker Hub (``ubuntu:22.04`` is
``docker.io/library/ubuntu:22.04``); no tag and no digest means ``latest``.

The operator's policy (``Policy.from_settings``):

* ``HANGAR_REGISTRIES``: the registries builds may pull from, by host
  (comma-separated; ``*``: any; default ``docker.io``). Any other is refused
  before anything is fetched.
* ``HANGAR_REGISTRY_MIRRORS``: ``registry=host[:port]`` pairs: the image is
  fetched from the mirror instead (same path and tag), e.g. a pull-through
  cache or a registry of the operator's own standing in for Docker Hub.
* ``HANGAR_REGISTRY_INSECURE``: hosts reached over plain HTTP (or HTTPS
  without a verified certificate): a registry on loopback or a LAN.
* ``HANGAR_REGISTRY_AUTH``: a ``containers-auth.json`` file (``skopeo
  login --authfile``'s format) with the operator's credentials per registry,
  read by root only. A build's own credentials (E2B's ``fromImageRegistry``
  with a username and password) are written to a file of its own (0600, in
  a folder of root's) for that one copy and removed with it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hangar.errors import ImageError, InvalidRequest
from hangar.images.commands import Progress, require_tools, run

REF_MAX = 255
"""Characters of a reference (the distribution project's limit on a repository name,
plus its tag)."""
PULL_MAX_BYTES = 8 << 30
"""Compressed bytes of an image's layers a pull may fetch (Docker Hub's largest common
images, CUDA's, are about 4-6 GiB); past it the build fails before fetching a layer."""
PULL_TIMEOUT_S = 1800.0
"""Longest one ``skopeo copy`` may take."""
INSPECT_TIMEOUT_S = 120.0
DOCKER_HUB = "docker.io"
PULLED_PREFIX = "reg-"
"""The names of images pulled for builds (``image_name``): ``hangar image gc`` collects
their current build too once nothing pins or uses it (a later build pulls again)."""

_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_PATH = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*$")
_HOST = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                   r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*)(?::[0-9]{1,5})?$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


@dataclass(frozen=True)
class Reference:
    """An image of a registry: ``registry`` (a host, ``docker.io`` for Docker Hub),
    ``path`` (``library/ubuntu``), ``tag`` and/or ``digest``."""

    registry: str
    path: str
    tag: str | None = None
    digest: str | None = None

    def __str__(self) -> str:
        return (f"{self.registry}/{self.path}" + (f":{self.tag}" if self.tag else "")
                + (f"@{self.digest}" if self.digest else ""))

    def at(self, host: str) -> str:
        """The same image on ``host`` (a mirror), as skopeo's ``docker://`` names it."""
        return (f"docker://{host}/{self.path}" + (f":{self.tag}" if self.tag else "")
                + (f"@{self.digest}" if self.digest else ""))


def parse(text: str) -> Reference:
    """``text`` as a ``Reference`` (see the module docstring); raises InvalidRequest
    naming what is wrong with it."""
    if not isinstance(text, str) or not 0 < len(text) <= REF_MAX:
        raise InvalidRequest(f"an image reference is 1-{REF_MAX} characters")
    if text.startswith("docker://"):
        text = text[len("docker://"):]
    rest, _, digest = text.partition("@")
    if digest and not _DIGEST.match(digest):
        raise InvalidRequest(f"image {text!r}: a digest is sha256: and 64 hex digits")
    head, _, tail = rest.partition("/")
    if tail and ("." in head or ":" in head or head == "localhost"):
        registry, rest = head, tail
        if not _HOST.match(registry):
            raise InvalidRequest(f"image {text!r}: {registry!r} is not a registry host")
    else:
        registry = DOCKER_HUB
    path, sep, tag = rest.rpartition(":") if ":" in rest else (rest, "", "")
    if sep and not _TAG.match(tag):
        raise InvalidRequest(f"image {text!r}: {tag!r} is not a tag")
    if registry == DOCKER_HUB and "/" not in path:
        path = f"library/{path}"
    if not _PATH.match(path):
        raise InvalidRequest(f"image {text!r}: {path!r} is not a repository name "
                             "(lower-case letters, digits, '.', '_', '-', '/')")
    return Reference(registry, path, tag or (None if digest else "latest"), digest or None)


def _hosts(text: str) -> tuple[str, ...]:
    return tuple(h.strip().lower() for h in text.split(",") if h.strip())


@dataclass(frozen=True)
class Policy:
    """Where pulls may go and how (the module docstring's settings)."""

    registries: tuple[str, ...] = (DOCKER_HUB,)
    mirrors: dict[str, str] = field(default_factory=dict)
    insecure: tuple[str, ...] = ()
    auth_file: Path | None = None

    @classmethod
    def from_settings(cls, settings: Any) -> "Policy":
        """The policy of a ``hangar.config.Settings``; raises InvalidRequest for a
        mirror pair that is not ``registry=host``."""
        mirrors: dict[str, str] = {}
        for pair in _hosts(settings.registry_mirrors):
            name, sep, host = pair.partition("=")
            if not sep or not _HOST.match(name) or not _HOST.match(host):
                raise InvalidRequest(f"HANGAR_REGISTRY_MIRRORS: {pair!r} is not registry=host")
            mirrors[name] = host
        return cls(_hosts(settings.registries) or (DOCKER_HUB,), mirrors,
                   _hosts(settings.registry_insecure), settings.registry_auth)

    def host(self, ref: Reference) -> str:
        """The host the image is fetched from (its registry, or that registry's mirror)."""
        return self.mirrors.get(ref.registry.lower(), ref.registry)

    def check(self, ref: Reference) -> None:
        """Raise InvalidRequest unless builds may pull from ``ref``'s registry."""
        if "*" not in self.registries and ref.registry.lower() not in self.registries:
            raise InvalidRequest(
                f"image {ref}: registry {ref.registry} is not one this server pulls from "
                f"(HANGAR_REGISTRIES: {', '.join(self.registries)})")

    def where(self, ref: Reference) -> str:
        """The registry, and its mirror if any, as error messages name them."""
        host = self.host(ref)
        return ref.registry if host == ref.registry else f"{ref.registry} (mirror {host})"

    def _args(self, ref: Reference, auth: Path | None) -> list[str]:
        host = self.host(ref)
        out = ["--src-tls-verify=false"] if host.lower() in self.insecure else []
        if auth is not None:
            out += ["--src-authfile", str(auth)]
        elif self.auth_file is not None:
            out += ["--src-authfile", str(self.auth_file)]
        else:
            out += ["--src-no-creds"]
        return out


def _auth_file(folder: Path, host: str, creds: dict[str, str]) -> Path | None:
    """A ``containers-auth.json`` of the build's own credentials for ``host`` (0600), or
    None when it brings none."""
    user, password = creds.get("username"), creds.get("password")
    if not user or password is None:
        return None
    path = folder / "auth.json"
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"auths": {host: {"auth": token}}}, f)
    return path


def _why(exc: ImageError) -> str:
    """skopeo's own reason, from the last lines of its output."""
    lines = [ln.strip() for ln in exc.message.splitlines()[1:] if ln.strip()]
    text = lines[-1] if lines else exc.message
    text = text.split("level=fatal msg=")[-1].strip('"').replace('\\"', '"')
    return re.sub(r'^Error parsing image name "[^"]*": ', "", text)[:400]


def pull(ref: Reference, layout: Path, policy: Policy, creds: dict[str, str],
         say: Progress) -> dict[str, Any]:
    """Copy ``ref`` into the OCI image layout folder ``layout`` (tag ``hangar``), after
    checking that the policy allows its registry and that its layers are at most
    ``PULL_MAX_BYTES``; ``creds`` (``username``, ``password``) override the operator's
    for this pull. Returns ``{"digest", "bytes"}`` of the image's manifest and layers.
    Raises InvalidRequest (a registry not allowed; an image too large) and ImageError
    naming the registry (unreachable, unknown image or tag, refused credentials)."""
    require_tools("skopeo")
    policy.check(ref)
    folder = layout.parent
    auth = _auth_file(folder, policy.host(ref), creds)
    args = policy._args(ref, auth)
    source = ref.at(policy.host(ref))
    try:
        say(f"[registry] inspecting {ref} at {policy.where(ref)}")
        top = _inspect(ref, source, args, policy)
        manifest = top
        if isinstance(top.get("manifests"), list):  # an index: the linux/amd64 image's
            digest = next((str(x.get("digest")) for x in top["manifests"]
                           if isinstance(x, dict) and isinstance(x.get("platform"), dict)
                           and x["platform"].get("os") == "linux"
                           and x["platform"].get("architecture") == "amd64"), None)
            if digest is None or not _DIGEST.match(digest):
                raise ImageError(f"image {ref} has no linux/amd64 image", registry=ref.registry)
            manifest = _inspect(ref, f"docker://{policy.host(ref)}/{ref.path}@{digest}",
                                args, policy)
        layers = [x for x in manifest.get("layers") or [] if isinstance(x, dict)]
        size = sum(int(x.get("size") or 0) for x in layers)
        if size > PULL_MAX_BYTES:
            raise InvalidRequest(f"image {ref} has {size} bytes of layers; a pull takes at "
                                 f"most {PULL_MAX_BYTES}")
        say(f"[registry] pulling {ref} ({len(layers)} layers, {size} bytes)")
        try:
            run("skopeo copy", ["skopeo", "--insecure-policy", "copy", "--quiet",
                                "--retry-times", "2", *args, source, f"oci:{layout}:hangar"],
                timeout=PULL_TIMEOUT_S)
        except ImageError as exc:
            raise ImageError(f"image {ref} could not be pulled from {policy.where(ref)}: "
                             f"{_why(exc)}", registry=ref.registry) from None
        return {"digest": str(top.get("_digest") or ""), "bytes": size}
    finally:
        if auth is not None:
            auth.unlink(missing_ok=True)


def _inspect(ref: Reference, where: str, args: list[str], policy: Policy) -> dict[str, Any]:
    """The manifest (or index) at ``where`` (skopeo's ``docker://`` name), as ``skopeo
    inspect --raw`` reads it, with ``_digest``: its SHA-256."""
    try:
        text = run("skopeo inspect", ["skopeo", "inspect", "--raw", "--retry-times", "1",
                                      *[a.replace("--src-", "--") for a in args], where],
                   timeout=INSPECT_TIMEOUT_S)
    except ImageError as exc:
        raise ImageError(f"image {ref} could not be pulled from {policy.where(ref)}: "
                         f"{_why(exc)}", registry=ref.registry) from None
    value = _inspected(text)
    value["_digest"] = "sha256:" + hashlib.sha256(text[text.find("{"):].encode()).hexdigest()
    return value


def _inspected(text: str) -> dict[str, Any]:
    """The JSON object ``skopeo inspect`` printed (its output may start with warnings)."""
    start = text.find("{")
    try:
        value = json.loads(text[start:]) if start >= 0 else None
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ImageError("skopeo inspect printed no image description")
    return value


def image_name(ref: Reference) -> str:
    """The Hangar image a pull of ``ref`` builds: ``reg-<repository>-<tag>-<hash>``, a
    template name (``hangar.images.template_file.NAME_RE``) unique to the reference."""
    h = hashlib.sha256(str(ref).encode()).hexdigest()[:10]
    words = [re.sub(r"[^a-z0-9]+", "-", (s or "").lower()).strip("-")
             for s in (ref.path.rsplit("/", 1)[-1], ref.tag)]
    return PULLED_PREFIX + "-".join([*(w[:20] for w in words if w), h])
