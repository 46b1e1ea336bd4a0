"""A Dockerfile as a template build the server runs: shared by the SDK
(``Hangar.build_template``) and the CLI (``hangar template build -d``).

``parse`` reads a Dockerfile into the steps of the server's template build
flow (``hangar.api.e2b.builds``, the flow E2B's SDK uses): ``FROM`` (one
stage: ``e2bdev/base`` is Hangar's base image, any other name one of the
server's images or templates, else a registry's image), ``RUN``,
``COPY``/``ADD`` (local files of the build context; ``--chown``,
``--chmod``), ``ENV``, ``ARG`` (its default), ``WORKDIR``, ``USER``,
``CMD``/``ENTRYPOINT`` (the start command), ``HEALTHCHECK CMD`` (the ready
command; else the first port ``EXPOSE`` names accepting). As Docker, the steps
run as root in ``/``; as for a template of E2B's, sandboxes then run as
``user`` in ``/home/user`` unless the Dockerfile set a ``USER`` or
``WORKDIR``. ``LABEL``, ``VOLUME``, ``STOPSIGNAL``, ``MAINTAINER``,
``SHELL`` and ``ONBUILD`` are skipped (each named in ``Plan.skipped``).
Every mistake is a ``DockerfileError`` naming its line.

The rest is what the SDK's build flow needs besides I/O: the request
bodies (``new_build_body``, ``start_body``), the error of a failed build
(``build_failed``, naming the Dockerfile's line) and the results
(``BuildLog``, ``TemplateBuild``). The flow itself (upload each ``COPY``'s
files, made by ``hangar.build_archive``; start; poll) is the SDK's
(``hangar.client._async.templates``), which the CLI calls. This module
imports neither the SDK nor the CLI nor the server.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from hangar.errors import InvalidRequest

__all__ = ["BASE_IMAGE", "BUILD_TIMEOUT_S", "SKIPPED", "BuildLog", "DockerfileError", "Plan",
           "TemplateBuild", "build_failed", "new_build_body", "parse", "read", "start_body"]

BASE_IMAGE = "e2bdev/base"
"""E2B's name of its base image, which Hangar serves as its ``base`` image."""
SKIPPED = {"LABEL", "VOLUME", "STOPSIGNAL", "MAINTAINER", "SHELL", "ONBUILD"}
"""Instructions that change nothing a sandbox of the template sees: named, not built."""
BUILD_TIMEOUT_S = 7200.0
"""How long a caller waits for a build to end by default, seconds: the server bounds no
build as a whole, and a build from a registry's image under software emulation takes
tens of minutes here; two hours is the CLI's wait since its Dockerfile form came."""
_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


class DockerfileError(InvalidRequest):
    """A Dockerfile this server cannot build; ``context["line"]`` is the line that says
    why (absent when the Dockerfile has no ``FROM`` at all)."""


@dataclass
class Plan:
    """A Dockerfile as a build: its base (``from_image``: E2B's base image or a
    registry's, else a template's name), the server's steps (a ``COPY``'s ``src`` is
    relative to the build context; its files hash is added by the build), the start and
    ready commands."""

    base: str
    from_image: bool
    maybe_image: bool = False
    """A bare name (``python:3.12``): the server's template of that name if it has one,
    else the registry's image (the build asks the server)."""
    steps: list[dict[str, Any]] = field(default_factory=list)
    lines: list[int | None] = field(default_factory=list)
    """The Dockerfile's line of each step (None for those the build adds)."""
    start: str | None = None
    ready: str | None = None
    skipped: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class BuildLog:
    """One line of a build's log: ``level`` (``debug``, ``info``, ``warn``, ``error``),
    ``message`` and ``timestamp`` (RFC 3339, UTC). The server's lines, and the client's
    own: a skipped instruction (``warn``), a ``COPY``'s upload (``info``)."""

    level: str
    message: str
    timestamp: str


@dataclass(frozen=True)
class TemplateBuild:
    """A template the server built from a Dockerfile: ``name`` (create sandboxes of it
    by this name through E2B's API), ``build_id`` (the server's id of this build),
    ``skipped`` (the instructions not built, as ``line 4: LABEL``) and ``seconds`` (from
    the first call to the build's end)."""

    name: str
    build_id: str
    skipped: tuple[str, ...]
    seconds: float


def _lines(text: str) -> list[tuple[int, str]]:
    """(line number, instruction) with continuations joined and comments dropped."""
    out: list[tuple[int, str]] = []
    buf, first = "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if buf and line.lstrip().startswith("#"):
            continue
        if not buf:
            first = n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        out.append((first, (buf + line).strip()))
        buf = ""
    if buf:
        out.append((first, buf.strip()))
    return out


def _command(rest: str) -> str:
    """A RUN/CMD/ENTRYPOINT's shell text: its exec form (a JSON array) joined for a shell."""
    if rest.startswith("["):
        try:
            argv = json.loads(rest)
        except ValueError:
            return rest
        if isinstance(argv, list) and all(isinstance(a, str) for a in argv):
            return shlex.join(argv)
    return rest


def parse(text: str) -> Plan:
    """The build a Dockerfile's ``text`` describes. Raises DockerfileError."""
    env: dict[str, str] = {}
    plan: Plan | None = None
    entrypoint = cmd = health = None
    port: int | None = None
    user_set = workdir_set = False

    def expand(s: str) -> str:
        return _VAR.sub(lambda m: env.get(m.group(1) or m.group(3) or "", m.group(2) or ""), s)

    def bad(why: str) -> DockerfileError:  # the instruction at hand: line n, word
        return DockerfileError(f"line {n} ({word}): {why}", line=n)

    prev = n = 0
    word = ""
    for n, line in _lines(text):
        if plan is not None:  # the steps the previous instruction added: its line
            plan.lines += [prev] * (len(plan.steps) - len(plan.lines))
        prev = n
        word, _, rest = line.partition(" ")
        word, rest = word.upper(), rest.strip()
        if word == "ARG":
            name, _, default = rest.partition("=")
            env.setdefault(name.strip(), default.strip().strip('"'))
            continue
        if word == "FROM":
            if plan is not None:
                raise bad("one FROM only (no multi-stage builds)")
            ref = expand(rest).split()[0] if rest else ""
            name = ref.split("@", 1)[0]
            if name.rsplit(":", 1)[0] == BASE_IMAGE:
                plan = Plan(base=BASE_IMAGE, from_image=True)
            elif re.fullmatch(r"[a-z0-9][a-z0-9_.-]*(:[A-Za-z0-9_.-]+)?", name):
                # the server's image or template of that name, else a registry's image
                plan = Plan(base=name, from_image=False, maybe_image=True)
            elif ref:
                plan = Plan(base=ref, from_image=True)  # a registry's: the server checks it
            else:
                raise bad("FROM names no image")
            plan.steps += [{"type": "USER", "args": ["root"]}, {"type": "WORKDIR", "args": ["/"]}]
            continue
        if plan is None:
            raise bad("the Dockerfile must start with FROM")
        if word == "RUN":
            if rest.startswith("--"):
                raise bad(f"RUN's options ({rest.split()[0]}) are not served")
            plan.steps.append({"type": "RUN", "args": [_command(rest)]})
        elif word in ("COPY", "ADD"):
            words = shlex.split(expand(rest))
            opts = {w.split("=", 1)[0]: w.split("=", 1)[1] if "=" in w else ""
                    for w in words if w.startswith("--")}
            paths = [w for w in words if not w.startswith("--")]
            if set(opts) - {"--chown", "--chmod"} or len(paths) < 2:
                raise bad("needs sources and a destination, and takes --chown and --chmod only")
            if any("://" in p for p in paths[:-1]):
                raise bad("a URL source is not served")
            for src in paths[:-1]:
                plan.steps.append({"type": "COPY", "args": [src, paths[-1],
                                   opts.get("--chown", ""), opts.get("--chmod", "")]})
        elif word == "ENV":
            pairs = shlex.split(expand(rest))
            if pairs and "=" not in pairs[0]:  # the older ENV key value
                key, _, value = expand(rest).partition(" ")
                pairs = [f"{key}={value.strip()}"]
            args: list[str] = []
            for p in pairs:
                key, eq, value = p.partition("=")
                if not eq:
                    raise bad(f"{p!r} is not KEY=VALUE")
                env[key] = value
                args += [key, value]
            plan.steps.append({"type": "ENV", "args": args})
        elif word == "WORKDIR":
            plan.steps.append({"type": "WORKDIR", "args": [expand(rest)]})
            workdir_set = True
        elif word == "USER":
            plan.steps.append({"type": "USER", "args": [expand(rest).split(":")[0]]})
            user_set = True
        elif word == "CMD":
            cmd = _command(rest)
        elif word == "ENTRYPOINT":
            entrypoint = _command(rest)
        elif word == "EXPOSE":
            first = expand(rest).split()[0].split("/")[0] if rest else ""
            if port is None and first.isdigit():
                port = int(first)
        elif word == "HEALTHCHECK":
            if rest.upper() == "NONE":
                health = ""
            elif " CMD " in f" {rest} ":
                health = _command(rest.split("CMD", 1)[1].strip())
        elif word in SKIPPED:
            plan.skipped.append(f"line {n}: {word}")
        else:
            raise bad("not an instruction this server builds")
    if plan is None:
        raise DockerfileError("the Dockerfile has no FROM")
    plan.lines += [prev] * (len(plan.steps) - len(plan.lines))
    plan.start = " ".join(c for c in (entrypoint, cmd) if c) or None
    if health:
        plan.ready = health
    elif health is None and port is not None and plan.start:
        plan.ready = f'[ -n "$(ss -Htuln sport = :{port})" ]'
    if not user_set:
        plan.steps.append({"type": "USER", "args": ["user"]})
    if not workdir_set:
        plan.steps.append({"type": "WORKDIR", "args": ["/home/user"]})
    plan.lines += [None] * (len(plan.steps) - len(plan.lines))
    return plan


def read(dockerfile: str | os.PathLike[str],
         context: str | os.PathLike[str] | None) -> tuple[Plan, Path]:
    """The plan of ``dockerfile`` (a path-like: the file, read; a ``str``: the
    Dockerfile's text) and the build context ``COPY`` reads (``context``, else the
    Dockerfile's folder for a path, else the current directory). Raises DockerfileError,
    InvalidRequest (the file cannot be read; a ``str`` of one word, such as a file's
    name)."""
    if isinstance(dockerfile, str):
        text = dockerfile
        if text.strip() and not any(ch.isspace() for ch in text.strip()):
            # one word is no Dockerfile (FROM needs its image): a file's name, meant as one
            raise InvalidRequest(f"{text[:200]!r} is not a Dockerfile's text: pass "
                                 f"Path({text[:200]!r}) to read the file")
        folder = Path.cwd()
    else:
        path = Path(dockerfile)
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise InvalidRequest(f"{path}: {why}") from None
        folder = path.resolve().parent
    return parse(text), Path(context) if context is not None else folder


def new_build_body(name: str, vcpus: int | None, memory_mib: int | None) -> dict[str, Any]:
    """The body of ``POST /e2b/v3/templates`` (E2B's names: ``cpuCount``, ``memoryMB``)."""
    return {"name": name, "cpuCount": vcpus, "memoryMB": memory_mib}


def start_body(plan: Plan, steps: list[dict[str, Any]], from_image: bool,
               force: bool) -> dict[str, Any]:
    """The body that starts the build (``POST /e2b/v2/templates/{id}/builds/{build}``):
    ``steps`` (the plan's, each ``COPY`` with its ``filesHash``), the base as an image
    or a template, the start and ready commands."""
    return {"steps": steps, "force": force, "startCmd": plan.start, "readyCmd": plan.ready,
            "fromImage" if from_image else "fromTemplate": plan.base}


def build_failed(plan: Plan, name: str, build_id: str,
                 reason: dict[str, Any] | None) -> InvalidRequest:
    """The error of a build that ended in ``error``: the server's reason (``message``;
    ``step``, E2B's 1-based number of the failed step) and the Dockerfile's line of that
    step, in the message and in ``context`` (``line``, ``step``, ``reason``, ``name``,
    ``build_id``)."""
    reason = reason or {}
    message = str(reason.get("message") or "no reason given")
    step = str(reason.get("step") or "")
    n = int(step) - 1 if step.isdigit() else -1
    line = plan.lines[n] if 0 <= n < len(plan.lines) else None
    where = f" (line {line})" if line is not None else ""
    return InvalidRequest(f"the build of {name} failed{where}: {message}", line=line,
                          step=step or None, reason=message, name=name, build_id=build_id)


def now() -> str:
    """The time now as a ``BuildLog``'s timestamp (RFC 3339, UTC, milliseconds)."""
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
