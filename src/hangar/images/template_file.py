"""Template files: a user's own guest image, described in TOML.

A template starts from a base (a recipe such as ``base``, ``desktop`` or
``dev``, or another template) or from an OCI image in a local archive,
and adds Debian packages, files, build steps, environment, a start command
and a ready check. ``hangar template build -f FILE`` builds it
(``hangar.images.template_builder``); sandboxes are then created from it by
name (``"image": "<name>"`` in ``POST /sandboxes``). Example::

    name = "webapp"                      # a-z, 0-9 and -, not a recipe's name
    base = "base"                        # or: oci = "image.tar" (docker save / OCI layout)
    description = "A Python web app"
    packages = ["tree"]                  # apt-get install (Debian bases only)
    env = { APP_ENV = "dev" }            # every exec, the start command, the build steps
    steps = ["python3 -m compileall -q /srv"]   # /bin/sh -c, in order, at build time
    network = false                      # steps reach the network (default: loopback only)
    workdir = "/srv"                     # where steps and the start command run
    start = "python3 -m http.server 8000"       # started in the background at boot
    vcpus = 1                            # defaults for sandboxes of this template
    memory_mib = 512

    [[files]]                            # copied into the image, in order
    src = "app"                          # a file or folder, relative to this file
    dest = "/srv"                        # absolute path in the guest
    [[files]]
    dest = "/etc/motd"
    content = "hello\\n"
    mode = "0644"

    [ready]                              # create answers once this passes
    port = 8000                          # a TCP port that accepts, or:
    # command = "curl -sf localhost:8000/health"   # a command that exits 0
    timeout = 60                         # seconds (default 60)

``load_template`` reads and checks a file; every mistake is an
``InvalidRequest`` naming the file and the field.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hangar.errors import InvalidRequest
from hangar.images.recipes import RECIPES
from hangar.schemas.bounds import (
    MEMORY_MIB_MAX, MEMORY_MIB_MIN, PORT_MAX, PORT_MIN, VCPUS_MAX, VCPUS_MIN,
)

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
"""Template names: what ``POST /sandboxes`` accepts as ``image``."""
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
TEMPLATE_FORMAT = 1
"""Bump when the same template file builds other bytes."""
READY_TIMEOUT_S = 60.0
MAX_FILE_BYTES = 512 << 20
"""Largest file or folder a template may copy in, bytes."""
KEYS = {"name", "description", "base", "oci", "packages", "env", "steps", "network", "workdir",
        "start", "vcpus", "memory_mib", "files", "ready"}


@dataclass(frozen=True)
class TemplateFile:
    """A file or folder copied into the image: from ``src`` (a host path) or ``content``."""

    dest: str
    src: Path | None = None
    content: str | None = None
    mode: int | None = None
    """Permission bits; None keeps the source's (0644 for ``content``)."""


@dataclass(frozen=True)
class ReadyCheck:
    """When a new sandbox counts as ready: ``port`` accepts, or ``command`` exits 0."""

    port: int | None = None
    command: str | None = None
    timeout_s: float = READY_TIMEOUT_S
    interval_s: float = 0.5

    def describe(self) -> str:
        return f"port {self.port} accepts" if self.port else f"`{self.command}` exits 0"


@dataclass(frozen=True)
class Template:
    """A parsed template file; paths in it are already resolved against its folder."""

    name: str
    base: str | None = None
    oci: Path | None = None
    description: str = ""
    packages: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    steps: tuple[str, ...] = ()
    network: bool = False
    """The steps run with the host's network (else in a network namespace of their own
    with a loopback only); see ``hangar.images.confined``."""
    workdir: str | None = None
    start: str | None = None
    ready: ReadyCheck | None = None
    vcpus: int | None = None
    memory_mib: int | None = None
    files: tuple[TemplateFile, ...] = ()
    source: Path | None = None
    """The file it was read from, if any."""

    def runtime(self) -> dict[str, Any]:
        """What sandboxes of it need at create (stored in the build's manifest)."""
        ready = None
        if self.ready is not None:
            ready = {"port": self.ready.port, "command": self.ready.command,
                     "timeout_s": self.ready.timeout_s, "interval_s": self.ready.interval_s}
        return {"start": self.start, "workdir": self.workdir, "ready": ready,
                "env": dict(self.env), "vcpus": self.vcpus, "memory_mib": self.memory_mib}

    def digest(self, base_id: str) -> str:
        """12 hex digits over everything that shapes a build of it, given its base's id
        (an image build id, or the OCI archive's SHA-256); files count by content."""
        files = [{"dest": f.dest, "mode": f.mode, "content": _content_hash(f)}
                 for f in self.files]
        blob = json.dumps({
            "format": TEMPLATE_FORMAT, "base": base_id, "packages": list(self.packages),
            "steps": list(self.steps), "files": files, **self.runtime(),
            **({"network": True} if self.network else {}),
        }, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def _content_hash(f: TemplateFile) -> str:
    h = hashlib.sha256()
    if f.content is not None:
        h.update(b"C" + f.content.encode())
        return h.hexdigest()
    assert f.src is not None
    paths = [f.src] if not f.src.is_dir() else sorted(f.src.rglob("*"))
    for p in paths:
        rel = p.relative_to(f.src).as_posix() if f.src.is_dir() else ""
        st = p.lstat()
        if p.is_symlink():
            h.update(f"L{rel}\0{p.readlink()}\0".encode())
        elif p.is_file():
            h.update(f"F{rel}\0{st.st_mode & 0o7777}\0".encode())
            with open(p, "rb") as src:
                for block in iter(lambda: src.read(1 << 20), b""):
                    h.update(block)
        elif p.is_dir():
            h.update(f"D{rel}\0{st.st_mode & 0o7777}\0".encode())
    return h.hexdigest()


class _Reader:
    """Checks one file's fields, naming the file and field in every error."""

    def __init__(self, where: str, data: dict[str, Any]) -> None:
        self.where = where
        self.data = data

    def fail(self, key: str, message: str) -> InvalidRequest:
        return InvalidRequest(f"{self.where}: {key}: {message}", field=key)

    def text(self, key: str, *, required: bool = False, max_len: int = 65536) -> str | None:
        v = self.data.get(key)
        if v is None:
            if required:
                raise self.fail(key, "is required")
            return None
        if not isinstance(v, str):
            raise self.fail(key, f"must be a string, not {type(v).__name__}")
        if "\0" in v or len(v) > max_len:
            raise self.fail(key, f"must be at most {max_len} characters, without NUL bytes")
        return v

    def strings(self, key: str) -> tuple[str, ...]:
        v = self.data.get(key, [])
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise self.fail(key, "must be a list of strings")
        if any("\0" in x or not x.strip() for x in v):
            raise self.fail(key, "entries must be non-empty and hold no NUL bytes")
        return tuple(v)

    def number(self, key: str, lo: float, hi: float, *, integer: bool = True) -> Any:
        v = self.data.get(key)
        if v is None:
            return None
        kinds = (int,) if integer else (int, float)
        if isinstance(v, bool) or not isinstance(v, kinds) or not lo <= v <= hi:
            raise self.fail(key, f"must be {'an integer' if integer else 'a number'} in "
                                 f"{lo:g}..{hi:g}")
        return v


def guest_path(r: _Reader, key: str, value: str) -> str:
    if not value.startswith("/") or ".." in value.split("/") or "\0" in value:
        raise r.fail(key, f"{value!r} must be an absolute path in the guest, without '..'")
    return value.rstrip("/") or "/"


def _mode(r: _Reader, key: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, str) and re.fullmatch(r"0?[0-7]{3,4}", value):
        return int(value, 8)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 0o7777:
        return value
    raise r.fail(key, "must be an octal string such as \"0755\"")


def parse_template(data: dict[str, Any], folder: Path, where: str = "template") -> Template:
    """A ``Template`` from decoded TOML ``data``; relative paths start at ``folder``.

    Raises InvalidRequest naming the field.
    """
    r = _Reader(where, data)
    unknown = sorted(set(data) - KEYS)
    if unknown:
        raise r.fail(unknown[0], f"unknown key (known: {', '.join(sorted(KEYS))})")
    name = r.text("name", required=True) or ""
    if not NAME_RE.match(name):
        raise r.fail("name", f"{name!r} must be 1-63 of a-z, 0-9 and '-', starting with a "
                             "letter or digit")
    if name in RECIPES:
        raise r.fail("name", f"{name!r} is a recipe's name; pick another")
    base, oci = r.text("base"), r.text("oci")
    if (base is None) == (oci is None):
        raise r.fail("base", "give exactly one of base (a recipe or template name) and oci "
                             "(an image archive)")
    if base is not None and (not NAME_RE.match(base) or base == name):
        raise r.fail("base", f"{base!r} must name another recipe or template")
    oci_path = None
    if oci is not None:
        oci_path = (folder / oci).resolve()
        if not oci_path.exists():
            raise r.fail("oci", f"{oci_path} does not exist")
    packages = r.strings("packages")
    for p in packages:
        if not re.fullmatch(r"[a-z0-9][a-z0-9+.-]{0,127}(=[A-Za-z0-9.+~:-]{1,64})?", p):
            raise r.fail("packages", f"{p!r} is not a Debian package name (name or name=version)")
    if packages and oci_path is not None:
        raise r.fail("packages", "needs a Debian base (base = ...); with oci, install them "
                                 "in steps with the image's own package manager")
    env_raw = data.get("env", {})
    if not isinstance(env_raw, dict):
        raise r.fail("env", "must be a table of NAME = \"value\"")
    env: dict[str, str] = {}
    for k, v in env_raw.items():
        if not ENV_NAME_RE.match(k) or not isinstance(v, str) or "\0" in v:
            raise r.fail("env", f"{k!r}: names are letters, digits and _, values strings "
                                "without NUL bytes")
        env[k] = v
    network = data.get("network", False)
    if not isinstance(network, bool):
        raise r.fail("network", "must be true or false")
    workdir = r.text("workdir")
    if workdir is not None:
        workdir = guest_path(r, "workdir", workdir)
    files: list[TemplateFile] = []
    raw_files = data.get("files", [])
    if not isinstance(raw_files, list) or not all(isinstance(f, dict) for f in raw_files):
        raise r.fail("files", "must be an array of tables ([[files]])")
    for i, f in enumerate(raw_files):
        fr = _Reader(f"{where}: files[{i}]", f)
        extra = sorted(set(f) - {"src", "dest", "content", "mode"})
        if extra:
            raise fr.fail(extra[0], "unknown key (known: src, dest, content, mode)")
        dest = guest_path(fr, "dest", fr.text("dest", required=True) or "")
        src, content = fr.text("src"), fr.text("content", max_len=1 << 20)
        if (src is None) == (content is None):
            raise fr.fail("src", "give exactly one of src (a host path) and content (text)")
        src_path = None
        if src is not None:
            src_path = (folder / src).resolve()
            if not src_path.exists():
                raise fr.fail("src", f"{src_path} does not exist")
        files.append(TemplateFile(dest=dest, src=src_path, content=content,
                                  mode=_mode(fr, "mode", f.get("mode"))))
    ready = None
    raw_ready = data.get("ready")
    if raw_ready is not None:
        if not isinstance(raw_ready, dict):
            raise r.fail("ready", "must be a table ([ready])")
        rr = _Reader(f"{where}: ready", raw_ready)
        extra = sorted(set(raw_ready) - {"port", "command", "timeout", "interval"})
        if extra:
            raise rr.fail(extra[0], "unknown key (known: port, command, timeout, interval)")
        port, command = rr.number("port", PORT_MIN, PORT_MAX), rr.text("command")
        if (port is None) == (command is None):
            raise rr.fail("port", "give exactly one of port and command")
        ready = ReadyCheck(port=port, command=command,
                           timeout_s=float(rr.number("timeout", 1, 3600, integer=False)
                                           or READY_TIMEOUT_S),
                           interval_s=float(rr.number("interval", 0.1, 60, integer=False)
                                            or 0.5))
    return Template(
        name=name, base=base, oci=oci_path, description=r.text("description") or "",
        packages=packages, env=env, steps=r.strings("steps"), network=network, workdir=workdir,
        start=r.text("start"), ready=ready, vcpus=r.number("vcpus", VCPUS_MIN, VCPUS_MAX),
        memory_mib=r.number("memory_mib", MEMORY_MIB_MIN, MEMORY_MIB_MAX), files=tuple(files),
    )


def load_template(path: Path) -> Template:
    """Read and check a template file (TOML). Raises InvalidRequest naming the problem."""
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise InvalidRequest(f"cannot read template file {path}: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"{path}: not valid TOML: {exc}") from None
    t = parse_template(data, path.resolve().parent, str(path))
    return dataclasses.replace(t, source=path.resolve())
