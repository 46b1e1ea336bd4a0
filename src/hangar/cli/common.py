"""What the ``hangar`` commands share: consoles, the ``--data-dir`` option, settings, the SDK.

``server_settings`` loads the server's settings for the commands that run
the server side on this host (and exits with a hint when its packages are
missing); ``sdk`` opens a client of the public SDK for the ones that talk to
a server. Errors print one line (``fail``) and exit 1.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, NoReturn, Optional

import typer
from rich.console import Console

from hangar.client import Hangar
from hangar.errors import HangarError

out = Console()
err = Console(stderr=True)

DataDir = Annotated[Optional[Path], typer.Option(help="Data directory (HANGAR_DATA_DIR).")]


def server_settings(data_dir: Path | None = None,
                    **overrides: object):  # type: ignore[no-untyped-def]
    """The server's settings; exits with a hint when the server's packages are missing."""
    try:
        import fastapi  # noqa: F401
        import sqlalchemy  # noqa: F401

        from hangar.config import Settings
    except ImportError as exc:
        err.print(f"[red]error:[/red] this command runs the server side, whose packages are not "
                  f"installed ({exc.name} is missing): pip install 'hangar\\[server]'")
        raise typer.Exit(1) from None

    if data_dir is not None:
        overrides["data_dir"] = data_dir
    return Settings(**{k: v for k, v in overrides.items() if v is not None})


@contextmanager
def sdk() -> Iterator[Hangar]:
    """A client of the public SDK; its errors print one line and exit 1."""
    try:
        with Hangar() as h:
            yield h
    except HangarError as exc:
        fail(exc)


def fail(exc: HangarError) -> NoReturn:
    """Print the error's message on one line and exit 1."""
    from rich.markup import escape

    err.print(f"[red]error:[/red] {escape(exc.message)}", highlight=False)
    if exc.status == 401:
        err.print(key_hint(), highlight=False, soft_wrap=True)
    raise typer.Exit(1)


def key_hint() -> str:
    """Where the CLI looked for its API key, for a 401."""
    import os

    from hangar.layout import Layout

    if os.environ.get("HANGAR_API_KEY"):
        return "the key came from HANGAR_API_KEY; check it against the server's keys"
    path = Layout.from_env().api_key_file
    found = "found" if path.is_file() else "missing"
    return (f"the key is read from HANGAR_API_KEY or {path} ({found}; its folder is "
            f"HANGAR_DATA_DIR); set one of them to a key the server accepts")


def build_recipe(layout, name: str, force: bool = False,  # type: ignore[no-untyped-def]
                 snapshot: bool = False):
    """Build (or reuse) recipe ``name``'s image, its steps shown on stderr; a GuestImage.
    ``snapshot``: then make its template snapshot (``hangar.core.templates``)."""
    from hangar.images import build_image

    with err.status(f"building image {name}") as status:
        def progress(msg: str) -> None:
            status.update(f"image {name}: {msg}")
            err.print(f"[dim]image {name}:[/dim] {msg}")

        img = build_image(layout, name, force=force, progress=progress)
        if snapshot:
            # The snapshot only saves the first create its boot: the image is built
            # whatever happens here, and the server makes the snapshot on its first
            # create if this could not (an install on a busy host must not fail on it).
            try:
                template_snapshot(layout, img, progress)
            except HangarError as exc:
                err.print(f"[yellow]warning:[/yellow] image {img.id} is built, but its "
                          f"template snapshot could not be made now ({exc.message}); the "
                          "server makes it on the first create")
        return img


def template_snapshot(layout, image, say) -> None:  # type: ignore[no-untyped-def]
    """A build command's last step: boot ``image`` with the server's engine and settings,
    run its start command until its ready check passes, and save its template snapshot
    (``hangar.core.templates.make_for_build``; reused when there is one). Run as root
    beside a split server, the step runs as that server's user through a root helper of
    its own (``hangar.cli.snapshot_step``): root never acts in the server's folders.
    Raises GuestError or Timeout (the template is broken), another HangarError (no
    snapshot now: the server makes it on its first create)."""
    import os

    from hangar.cli import snapshot_step
    from hangar.core.templates import make_for_build
    from hangar.errors import EngineError
    from hangar.server import pick_engine

    if os.geteuid() == 0:
        try:
            server_user = snapshot_step.where(layout, image.id)
            if server_user is not None:
                made = snapshot_step.as_server(layout, image, say)
                if made is None:
                    say(f"{image.id}: no template snapshot made now; the server makes it "
                        "on the first create")
                return
        except OSError as exc:
            raise EngineError(f"root acts on no folder of {layout.root} that others may "
                              f"change ({exc.strerror or exc})", image=image.id) from None
    settings = server_settings(layout.root)
    make_for_build(layout, image, pick_engine(settings, layout), settings, say)


def pinned_images(layout) -> set[str]:  # type: ignore[no-untyped-def]
    """Image ids that sandboxes, snapshots and machines in the data dir's store pin."""
    if not layout.database.exists():
        return set()
    from hangar.core.lifecycle import GONE, State
    from hangar.core.store import MachineRecord, SandboxRecord, SnapshotRecord, Store
    from hangar.images import image_id

    store = Store(layout.database)
    try:
        pins: set[str] = set()

        def pin(name: str, digest: str) -> None:  # a record without a digest pins the name
            pins.add(image_id(name, digest) if digest else name)

        for rec in store.all():
            if State(rec.state) not in GONE:
                pin(rec.image, rec.image_digest)
        for snap in store.list(SnapshotRecord):
            pin(snap.image, snap.image_digest)
        for m in store.list(MachineRecord):
            found = store.find(SandboxRecord, m.sandbox_id)
            if found is not None:
                pin(found.image, found.image_digest)
        return pins
    finally:
        store.engine.dispose()
