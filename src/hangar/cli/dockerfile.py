"""``hangar template build --dockerfile``: a Dockerfile as a template build's steps, built by
the server.

``parse`` reads a Dockerfile into the steps of the server's template build
flow (``hangar.api.e2b.builds``, the flow E2B's SDK uses): ``FROM`` (one
stage: ``e2bdev/base`` is Hangar's base image, any other name one of the
server's images or templates), ``RUN``, ``COPY``/``ADD`` (local files of the
build context; ``--chown``, ``--chmod``), ``ENV``, ``ARG`` (its default),
``WORKDIR``, ``USER``, ``CMD``/``ENTRYPOINT`` (the start command),
``HEALTHCHECK CMD`` (the ready command; else the first ``EXPOSE``d port
accepting). As Docker, the steps run as root in ``/``; as for a template of
E2B's, sandboxes then run as ``user`` in ``/home/user`` unless the
Dockerfile set a ``USER`` or ``WORKDIR``. ``LABEL``, ``VOLUME``,
``STOPSIGNAL``, ``MAINTAINER``, ``SHELL`` and ``ONBUILD`` are skipped (each
named in ``Plan.skipped``). Every mistake is a ``DockerfileError`` naming
its line.

``build`` then uploads each ``COPY``'s files (``hangar.build_archive``) and
runs the build, passing each log line to ``say``.
"""

from __future__ import annotations

import json
import re
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from hangar.build_archive import archive_hash, make_archive
from hangar.errors import InvalidRequest

BASE_IMAGE = "e2bdev/base"
SKIPPED = {"LABEL", "VOLUME", "STOPSIGNAL", "MAINTAINER", "SHELL", "ONBUILD"}
_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


class DockerfileError(InvalidRequest):
    """A Dockerfile this server cannot build, with the line that says why."""


@dataclass
class Plan:
    """A Dockerfile as a build: its base (``from_image``: E2B's base image or a
    registry's, else a template's name), the server's steps (a ``COPY``'s ``src`` is relative to the build
    context; its files hash is added by ``build``), the start and ready commands."""

    base: str
    from_image: bool
    maybe_image: bool = False
    """A bare name (``python:3.12``): the server's template of that name if it has one,
    else the registry's image (``build`` asks the server)."""
    steps: list[dict[str, Any]] = field(default_factory=list)
    lines: list[int | None] = field(default_factory=list)
    """The Dockerfile's line of each step (None for those the build adds)."""
    start: str | None = None
    ready: str | None = None
    skipped: list[str] = field(default_factory=list)


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
    """The build a Dockerfile describes. Raises DockerfileError."""
    env: dict[str, str] = {}
    plan: Plan | None = None
    entrypoint = cmd = health = None
    port: int | None = None
    user_set = workdir_set = False

    def expand(s: str) -> str:
        return _VAR.sub(lambda m: env.get(m.group(1) or m.group(3) or "", m.group(2) or ""), s)

    prev = 0
    for n, line in _lines(text):
        if plan is not None:  # the steps the previous instruction added: its line
            plan.lines += [prev] * (len(plan.steps) - len(plan.lines))
        prev = n
        word, _, rest = line.partition(" ")
        word, rest = word.upper(), rest.strip()
        where = f"line {n} ({word})"
        if word == "ARG":
            name, _, default = rest.partition("=")
            env.setdefault(name.strip(), default.strip().strip('"'))
            continue
        if word == "FROM":
            if plan is not None:
                raise DockerfileError(f"{where}: one FROM only (no multi-stage builds)")
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
                raise DockerfileError(f"{where}: FROM names no image")
            plan.steps += [{"type": "USER", "args": ["root"]}, {"type": "WORKDIR", "args": ["/"]}]
            continue
        if plan is None:
            raise DockerfileError(f"{where}: the Dockerfile must start with FROM")
        if word == "RUN":
            if rest.startswith("--"):
                raise DockerfileError(f"{where}: RUN's options ({rest.split()[0]}) are not served")
            plan.steps.append({"type": "RUN", "args": [_command(rest)]})
        elif word in ("COPY", "ADD"):
            words = shlex.split(expand(rest))
            opts = {w.split("=", 1)[0]: w.split("=", 1)[1] if "=" in w else ""
                    for w in words if w.startswith("--")}
            paths = [w for w in words if not w.startswith("--")]
            if set(opts) - {"--chown", "--chmod"} or len(paths) < 2:
                raise DockerfileError(f"{where}: needs sources and a destination, and takes "
                                      "--chown and --chmod only")
            if any("://" in p for p in paths[:-1]):
                raise DockerfileError(f"{where}: a URL source is not served")
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
                    raise DockerfileError(f"{where}: {p!r} is not KEY=VALUE")
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
            raise DockerfileError(f"{where}: not an instruction this server builds")
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


def build(http: httpx.Client, plan: Plan, name: str, context: Path, *,
          vcpus: int | None = None, memory_mib: int | None = None, force: bool = False,
          say: Callable[[str, str], None] = lambda level, text: None,
          timeout_s: float = 7200.0) -> str:
    """Build ``plan`` as template ``name`` on the server ``http`` talks to (its base URL
    the server's, its key set); returns the build's id. Raises InvalidRequest (a COPY's
    files are missing, the server refused a call, the build failed: its reason) and
    TimeoutError."""
    r = check(http.post("/e2b/v3/templates", json={
        "name": name, "cpuCount": vcpus, "memoryMB": memory_mib}))
    template, build_id = r["templateID"], r["buildID"]
    steps = [dict(s) for s in plan.steps]
    for s in steps:
        if s["type"] != "COPY":
            continue
        src, dest = s["args"][0], s["args"][1]
        try:
            tar = make_archive(context, src)
        except ValueError as exc:
            raise InvalidRequest(f"COPY {src} {dest}: {exc}") from None
        try:
            s["filesHash"] = archive_hash(tar, src, dest)
            link = check(http.get(f"/e2b/templates/{template}/files/{s['filesHash']}"))
            if not link["present"]:
                with open(tar, "rb") as f:
                    check(httpx.put(link["url"], content=f, timeout=3600))
                say("info", f"uploaded the files of COPY {src} {dest}")
        finally:
            tar.unlink(missing_ok=True)
    body: dict[str, Any] = {"steps": steps, "force": force, "startCmd": plan.start,
                            "readyCmd": plan.ready}
    from_image = plan.from_image
    if plan.maybe_image:
        from_image = http.get(f"/e2b/templates/aliases/{plan.base}").status_code == 404
    body["fromImage" if from_image else "fromTemplate"] = plan.base
    check(http.post(f"/e2b/v2/templates/{template}/builds/{build_id}", json=body))
    offset, deadline = 0, time.monotonic() + timeout_s
    while True:
        st = check(http.get(f"/e2b/templates/{template}/builds/{build_id}/status",
                            params={"logsOffset": offset}))
        for entry in st["logEntries"]:
            say(entry["level"], entry["message"])
        offset += len(st["logEntries"])
        if st["status"] in ("ready", "error") and not st["logEntries"]:
            if st["status"] == "error":
                step = str(st["reason"].get("step") or "")
                n = int(step) - 1 if step.isdigit() else -1  # E2B's 1-based step number
                where = f" (line {plan.lines[n]})" if 0 <= n < len(plan.lines) and \
                    plan.lines[n] is not None else ""
                raise InvalidRequest(f"the build failed{where}: {st['reason']['message']}")
            return build_id
        if time.monotonic() > deadline:
            raise TimeoutError(f"the build ran past {timeout_s:.0f} s")
        if not st["logEntries"]:
            time.sleep(0.3)


def check(r: httpx.Response) -> Any:
    """``r``'s JSON (None when empty), or its error raised as the server named it."""
    if r.status_code >= 400:
        try:
            message = r.json().get("message") or r.text
        except ValueError:
            message = r.text
        raise InvalidRequest(f"the server answered {r.status_code}: {message[:500]}")
    return r.json() if r.content else None
