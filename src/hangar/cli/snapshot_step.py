"""A root build's template-snapshot step beside a split server, made as that server's user.

``hangar image build`` and ``hangar template build`` end by making the
build's template snapshot (``hangar.core.templates.make_for_build``), so
that the first create restores it instead of booting cold. Beside a split
server the folders that step works in are the server's (``<data>``,
``sandboxes/``, ``images/``' folders, ``template-snapshots/``): it boots a
VM in ``sandboxes/tpl-<sid>``, takes ``.<key>.lock``, writes the snapshot
beside it and confines QEMU on the image folder, each by a name a
compromised server may swap for a symlink at any moment (review 29b, G3 and
G13). Root therefore never does that step itself there:

- ``where`` tells which case a data directory is: the server's user (split:
  the step runs as that user), root alone (no split: root runs the step
  itself, in folders no one else may write), or neither (a folder of
  another user or a symlink where root's should be: refused, the server
  makes the snapshot on its first create);
- ``as_server`` runs this module (``main``) as a new root process that
  forks a root helper and drops to the server's user for good
  (``hangar.roothelper.beside``, the split of ``hangar serve`` without the
  hand-over), then makes the snapshot exactly as that server does on a
  first create: as its user, every root act through the helper's request
  table (which opens the data directory itself and walks every name below
  it without following a symlink). Same user, engine, accelerator,
  settings and key: the snapshot the installed server restores.

The child's progress lines come on its stdout, then one line ``RESULT`` and
JSON: ``{"made": folder or null}`` or ``{"error": message, "broken":
bool}`` (``broken``: the template's start command or ready check failed).
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from hangar.errors import EngineError, GuestError, HangarError, Timeout
from hangar.privileged import beneath

if TYPE_CHECKING:
    from hangar.images import GuestImage
    from hangar.layout import Layout

RESULT = "hangar-snapshot-step-result "
"""Prefix of the child's last stdout line (its JSON result)."""
STEP_FOLDERS = ("sandboxes", "images")
"""Folders of the data directory the step works in, besides the build's own."""


def where(layout: "Layout", image_id: str) -> tuple[int, int] | None:
    """Who makes ``image_id``'s template snapshot: ``(uid, gid)`` of the split server's
    user that owns the data directory (``as_server``), or None when the data directory,
    ``sandboxes``, ``images``, the build and its ``template-snapshots`` are root's and
    writable by root alone (root makes it itself). Walked from ``/`` without following a
    link anyone but root may have put. Raises OSError (a symlink, or a folder of another
    user or writable by others, where root's should be)."""
    top = beneath.open_trusted(layout.root)
    try:
        st = os.fstat(top)
        if st.st_uid != 0:
            return st.st_uid, st.st_gid
        for rel in (*STEP_FOLDERS, f"images/{image_id}", f"images/{image_id}/template-snapshots"):
            try:
                fd = beneath.walk(top, rel, directory=True)
            except FileNotFoundError:
                continue
            try:
                fst = os.fstat(fd)
                if fst.st_uid != 0 or fst.st_mode & 0o022:
                    raise OSError(errno.EPERM, f"{layout.root / rel} is not root's alone "
                                               "though the data directory is")
            finally:
                os.close(fd)
        return None
    finally:
        os.close(top)


def as_server(layout: "Layout", image: "GuestImage", say: Callable[[str], None]
              ) -> Path | None:
    """Make ``image``'s template snapshot as the split server's user (module docstring):
    hands the build to that user first (``hand_new``: a template build is root's until
    then), runs ``main`` in a new process and relays its progress to ``say``. Returns
    the snapshot's folder, or None (this engine makes none, or making it failed for
    another reason than the template: the server makes it on its first create). Raises
    GuestError or Timeout (the template's start command or ready check failed), OSError
    (the build could not be handed over)."""
    from hangar.privileged.split import hand_new

    hand_new(layout.root, image.dir)
    argv = [sys.executable, "-m", "hangar.cli.snapshot_step", str(layout.root),
            image.name, image.digest]
    result: dict[str, object] = {"error": "the step ended without an answer",
                                 "broken": False}
    with subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
                          errors="replace", cwd="/") as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            if line.startswith(RESULT):
                result = json.loads(line[len(RESULT):])
            elif line:
                say(line)
    if proc.returncode != 0 and "made" not in result:
        result.setdefault("error", f"the step exited with {proc.returncode}")
    if "error" in result:
        message = str(result["error"])
        if result.get("broken"):
            raise GuestError(message, image=image.id)
        raise EngineError(f"as the server's user: {message}", image=image.id)
    made = result.get("made")
    return Path(str(made)) if made else None


def main(argv: list[str]) -> int:
    """The child ``as_server`` runs (as root): ``argv`` is the data directory, the
    build's name and digest. Prints progress, then ``RESULT`` and its JSON."""
    from hangar.cli.split_setup import host_jail, probe_as_root
    from hangar.config import Settings
    from hangar.core.launch import network_manager
    from hangar.core.templates import make_for_build
    from hangar.engines.confine import Confinement, config_from
    from hangar.images import resolve_pinned
    from hangar.layout import Layout
    from hangar.roothelper import beside
    from hangar.server import pick_engine

    data_dir, name, digest = argv

    def say(msg: str) -> None:
        print(msg, flush=True)

    def answer(result: dict[str, object]) -> int:
        print(RESULT + json.dumps(result), flush=True)
        return 0

    given: dict[str, object] = {"data_dir": Path(data_dir)}  # the rest from the environment
    settings = Settings(**given)  # type: ignore[arg-type]
    layout = Layout(settings.data_dir)
    try:
        owner = where(layout, f"{name}-{digest}")
        if owner is None:
            return answer({"error": f"{layout.root} is root's: no server's user to act as",
                           "broken": False})
        jail = host_jail(settings)
        if jail is not None and settings.engine == "auto":
            probe_as_root(settings, layout)
        pid, helper = beside(layout, Confinement(config_from(settings)), *owner,
                             net=network_manager(settings), jail=jail)
    except (HangarError, OSError) as exc:
        return answer({"error": exc.message if isinstance(exc, HangarError) else str(exc),
                       "broken": False})
    # from here on this process is the server's user; the helper (pid) is root
    try:
        image = resolve_pinned(layout, name, digest)
        made = make_for_build(layout, image, pick_engine(settings, layout, helper), settings,
                              say)
        result: dict[str, object] = {"made": str(made) if made else None}
    except (GuestError, Timeout) as exc:
        result = {"error": exc.message, "broken": True}
    except HangarError as exc:
        result = {"error": exc.message, "broken": False}
    except OSError as exc:
        result = {"error": str(exc), "broken": False}
    finally:
        helper.sock.close()  # the helper ends with its server's end of the socket
        os.waitpid(pid, 0)
    return answer(result)


if __name__ == "__main__":  # pragma: no cover (run by ``as_server`` as a new process)
    sys.exit(main(sys.argv[1:]))
