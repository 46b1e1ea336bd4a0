"""``python -m hangar.images.pull DATA NAME REF``: a registry's image as a Hangar image.

Run as root, by the root helper for a split server (``hangar.roothelper``'s
``image_pull``) or by a server that is root itself (``hangar.core.pulls``);
its settings are the server's environment (``hangar.config.Settings``:
the registry policy of ``hangar.images.registry``). Reads the build's own
registry credentials, if any, from stdin as one JSON object (``username``,
``password``; at most ``CREDS_MAX`` bytes: never an argument, which other
users could read in ``/proc``).

Pulls ``REF`` into an OCI image layout in a folder of root's
(``tempfile.mkdtemp``: 0700), then builds the template ``NAME`` from it
(``hangar.images.template_builder.build_template``: every layer checked
by ``oci_check``, unpacked by umoci, the guest runtime added, packed); an
image unchanged since its last pull reuses that build. Prints progress lines,
then ``IMAGE <build id>``; on failure ``ERROR: <message>`` as its last line
and exit status 2 (the build's own fault: the registry, the image) or 1.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from hangar.config import Settings
from hangar.errors import HangarError, ImageError, InvalidRequest
from hangar.images import registry
from hangar.images.template_builder import build_template
from hangar.images.template_file import NAME_RE, Template
from hangar.layout import Layout
from hangar.privileged.protocol import PullProgress

CREDS_MAX = 16 << 10
"""Bytes of the credentials object read from stdin."""
PULLS_MAX = 2
"""Pulls one host runs at once (each unpacks and packs a tree: disk- and CPU-bound)."""
LINES_MAX = 64
"""Output lines one ``Pulls.poll`` returns."""
READ_MAX = 32 << 10
"""Bytes of output one ``Pulls.poll`` reads."""


@dataclass
class _Pull:
    proc: subprocess.Popen[bytes]
    out: IO[bytes]


class Pulls:
    """The pulls this process runs as children (``python -m hangar.images.pull``, as
    root): the root helper's for a split server, a root server's own otherwise. Output
    goes to an unnamed temporary file of root's, read back by offset. Not thread-safe:
    one caller (the helper's loop, or the server's event loop through a thread that
    takes turns)."""

    def __init__(self, data: Path) -> None:
        self.data = data
        self.running: dict[str, _Pull] = {}

    def start(self, name: str, ref: str, username: str | None = None,
              password: str | None = None) -> None:
        """Start pulling ``ref`` as image ``name``. Raises InvalidRequest (a bad name
        or reference; ``name`` is being pulled already; ``PULLS_MAX`` pulls run)."""
        if not NAME_RE.match(name):
            raise InvalidRequest(f"{name!r} is not an image name")
        registry.parse(ref)
        if name in self.running:
            raise InvalidRequest(f"image {name} is being pulled already")
        if len(self.running) >= PULLS_MAX:
            raise InvalidRequest(f"{PULLS_MAX} images are being pulled already; "
                                 "try again when one is done")
        out = tempfile.TemporaryFile(prefix="hangar-pull-")
        creds = json.dumps({"username": username, "password": password}
                           if username else {}).encode()
        proc = subprocess.Popen(
            [sys.executable, "-m", "hangar.images.pull", str(self.data), name, ref],
            stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, cwd="/",
            start_new_session=True)
        assert proc.stdin is not None
        try:
            proc.stdin.write(creds)
            proc.stdin.close()
        except OSError:
            pass  # it ended already: its exit status says why
        self.running[name] = _Pull(proc, out)

    def poll(self, name: str, offset: int) -> PullProgress:
        """The pull of ``name``: its output from byte ``offset`` (whole lines, at most
        ``LINES_MAX``) and its exit status once it ended and its output is read; it is
        forgotten then. Raises InvalidRequest when no pull of ``name`` runs."""
        pull = self.running.get(name)
        if pull is None:
            raise InvalidRequest(f"no pull of image {name} runs")
        code = pull.proc.poll()
        pull.out.seek(max(0, offset))
        chunk = pull.out.read(READ_MAX)
        end = chunk.rfind(b"\n") + 1
        if code is not None and len(chunk) < READ_MAX and end < len(chunk):
            chunk += b"\n"  # its last line, unended
            end = len(chunk)
        raw = chunk[:end].split(b"\n")[:-1][:LINES_MAX]
        used = sum(len(ln) + 1 for ln in raw)
        lines = [ln.decode("utf-8", "replace") for ln in raw]
        done = code is not None and len(chunk) == used < READ_MAX
        if done:
            pull.out.close()
            del self.running[name]
        return {"exit": code if done else None, "lines": [ln[:2000] for ln in lines],
                "offset": offset + used}

    def stop_all(self) -> None:
        """End every pull (its whole process group) and forget it."""
        for pull in self.running.values():
            try:
                os.killpg(pull.proc.pid, signal.SIGKILL)
            except OSError:
                pass
            pull.proc.wait()
            pull.out.close()
        self.running.clear()


def _say(line: str) -> None:
    print(line[:2000], flush=True)


def pull_image(data: Path, name: str, text: str, creds: dict[str, str]) -> str:
    """Pull ``text`` and build it as image ``name`` of the data directory ``data``;
    returns the build's id. Raises InvalidRequest and ImageError (``registry.pull``,
    ``build_template``)."""
    if not NAME_RE.match(name):
        raise InvalidRequest(f"{name!r} is not an image name")
    ref = registry.parse(text)
    policy = registry.Policy.from_settings(Settings())
    policy.check(ref)
    folder = Path(tempfile.mkdtemp(prefix="hangar-pull-"))
    try:
        got = registry.pull(ref, folder / "layout", policy, creds, _say)
        t = Template(name=name, oci=folder / "layout",
                     description=f"{ref} ({got['digest'] or 'no digest'})")
        image = build_template(Layout(data), t, progress=_say)
        return image.id
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("ERROR: usage: python -m hangar.images.pull DATA NAME REF", flush=True)
        return 1
    try:
        raw = sys.stdin.read(CREDS_MAX) if not sys.stdin.isatty() else ""
        creds = json.loads(raw) if raw.strip() else {}
        if not isinstance(creds, dict):
            raise InvalidRequest("the credentials are one JSON object")
        image_id = pull_image(Path(argv[0]), argv[1], argv[2],
                              {k: str(v) for k, v in creds.items() if k in
                               ("username", "password")})
    except (InvalidRequest, ImageError) as exc:
        print(f"ERROR: {exc.message}".replace("\n", " ")[:2000], flush=True)
        return 2
    except (HangarError, ValueError, OSError) as exc:
        print(f"ERROR: {type(exc).__name__}: {exc}".replace("\n", " ")[:2000], flush=True)
        return 1
    print(f"IMAGE {image_id}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
