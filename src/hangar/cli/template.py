"""``hangar template build|import|ls|rm``: users' own guest images, built on this host
(a TOML file) or by the server (a Dockerfile: the SDK's ``build_template``, whose
parsing and requests are ``hangar.dockerfile``'s).

Like ``hangar image build`` these work on the data directory's image cache
(``hangar.images.template_builder``); a running server sees a new template
at its next create (``"image": "<name>"``). ``build`` takes a TOML file
(``hangar.images.template_file``); ``import`` makes a template of an OCI
image archive (``docker save`` tarball or OCI layout) without one. An
archive is checked member by member before it is unpacked (an image with a
device node, or a path or link out of its tree, is refused with the
member's name), and a template's packages and steps run in a build
namespace, never as host root (``hangar.images.confined``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Column, Table

from hangar.cli.common import (
    DataDir, err, fail, out, pinned_images, server_settings, template_snapshot,
)
from hangar.errors import HangarError

app = typer.Typer(help="Templates: your own guest images (a TOML file, or an OCI image).",
                  no_args_is_help=True)


def _layout(data_dir: Path | None):  # type: ignore[no-untyped-def]
    from hangar.layout import Layout

    layout = Layout(server_settings(data_dir).data_dir)
    layout.ensure()
    return layout


def _build(layout, template, force: bool,  # type: ignore[no-untyped-def]
           snapshot: bool = True) -> None:
    """Build with a live display: a spinner on the current step, each step's line with the
    time it started."""
    from hangar.images.template_builder import build_template

    t0 = time.monotonic()
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=err, transient=True) as progress:
        task = progress.add_task(f"template {template.name}", total=None)

        def say(msg: str) -> None:
            progress.update(task, description=f"template {template.name}: {escape(msg[:100])}")
            progress.console.print(f"[dim]{time.monotonic() - t0:6.1f} s[/dim]  {escape(msg)}",
                                   highlight=False)

        try:
            img = build_template(layout, template, force=force, progress=say)
            if snapshot:
                template_snapshot(layout, img, say)
        except HangarError as exc:
            progress.stop()
            fail(exc)
    took = time.monotonic() - t0
    err.print(f"[green]✓[/green] template {template.name}: {img.id} ({took:.1f} s)")
    out.print(f"{img.id} {img.dir}")


@app.command("build")
def build(
    file: Annotated[Optional[Path], typer.Option(
        "-f", "--file", help="The template file (TOML): built on this host.")] = None,
    dockerfile: Annotated[Optional[Path], typer.Option(
        "-d", "--dockerfile", help="A Dockerfile, built by the server (HANGAR_URL) in a build "
                                   "sandbox; give the template's NAME too.")] = None,
    name: Annotated[Optional[str], typer.Argument(
        help="The template's name (with --dockerfile).")] = None,
    context: Annotated[Optional[Path], typer.Option(
        help="Where COPY reads (with --dockerfile; default: the Dockerfile's folder).")] = None,
    force: Annotated[bool, typer.Option(
        help="Make a new build even if one of this file exists.")] = False,
    snapshot: Annotated[bool, typer.Option(
        help="Then boot it, run its start command until its ready check passes and save "
             "its template snapshot, which creates restore (else the server makes it on "
             "the first create).")] = True,
    data_dir: DataDir = None,
) -> None:
    """Build a template: from its TOML file on this host (reused at once while the file,
    its files and its base are unchanged), then its template snapshot, printing the
    build's id and directory; or from a Dockerfile on the server, printing the template's
    name and build id (docs/ports-and-templates.md)."""
    if (file is None) == (dockerfile is None):
        fail(HangarError("give a template file (-f) or a Dockerfile (-d NAME)"))
    if dockerfile is not None:
        _build_dockerfile(dockerfile, name, context, force)
        return
    from hangar.images.template_file import load_template

    assert file is not None
    try:
        template = load_template(file)
    except HangarError as exc:
        fail(exc)
    _build(_layout(data_dir), template, force, snapshot)


def _build_dockerfile(path: Path, name: str | None, context: Path | None,
                      force: bool) -> None:
    """A Dockerfile's template, built by the server through the SDK's ``build_template``
    (``hangar.dockerfile``), its log printed as it comes."""
    from hangar.cli.common import sdk
    from hangar.dockerfile import BuildLog

    if not name:
        fail(HangarError("give the template's NAME after the Dockerfile"))
    t0 = time.monotonic()

    def say(line: BuildLog) -> None:
        style = {"error": "red", "warn": "yellow"}.get(line.level, "dim")
        err.print(f"[dim]{time.monotonic() - t0:6.1f} s[/dim]  "
                  f"[{style}]{escape(line.message)}[/{style}]", highlight=False)

    with sdk() as h:  # the server's URL and key, as every command finds them
        done = h.build_template(name, path, context=context, force=force, on_log=say)
    err.print(f"[green]✓[/green] template {name}: build {done.build_id} "
              f"({done.seconds:.1f} s)")
    out.print(f"{name} {done.build_id}")


@app.command("import")
def import_(
    archive: Annotated[Path, typer.Argument(help="`docker save` tarball, OCI layout (folder "
                                                 "or tarball).")],
    name: Annotated[str, typer.Option(help="The template's name.")],
    start: Annotated[Optional[str], typer.Option(
        help="Command started at boot (the image's CMD is not run by itself).")] = None,
    ready_port: Annotated[Optional[int], typer.Option(
        help="Create answers once this guest port accepts.")] = None,
    force: Annotated[bool, typer.Option(help="Make a new build even if one exists.")] = False,
    data_dir: DataDir = None,
) -> None:
    """Make a template of an OCI image from a local archive, with Hangar's init, agent and
    Python runtime added (the image needs no Python; /bin/sh for shell commands). An image
    with device nodes, or paths or links out of its tree, is refused."""
    from hangar.images.template_file import parse_template

    data: dict[str, object] = {"name": name, "oci": str(archive.resolve())}
    if start is not None:
        data["start"] = start
    if ready_port is not None:
        data["ready"] = {"port": ready_port}
    try:
        template = parse_template(data, Path.cwd(), "import")
    except HangarError as exc:
        fail(exc)
    _build(_layout(data_dir), template, force)


@app.command("ls")
def ls(data_dir: DataDir = None) -> None:
    """List templates: their current build, base and start command."""
    from hangar.images import list_images, resolve_image

    layout = _layout(data_dir)
    table = Table("from", "start", "rootfs (MiB)", "built")
    table.columns.insert(0, Column("build", no_wrap=True, overflow="fold"))
    table.columns.insert(0, Column("name", no_wrap=True, overflow="fold"))
    for i in list_images(layout):
        if not (i.template and i.current):
            continue
        t = resolve_image(layout, i.name).template or {}
        table.add_row(i.name, i.id, str(t.get("base") or f"oci {t.get('oci')}"),
                      str(t.get("start") or ""), f"{i.rootfs_bytes / 2**20:.0f}",
                      time.strftime("%Y-%m-%d %H:%M", time.localtime(i.built_at)))
    out.print(table)


@app.command("rm")
def rm(name: str, data_dir: DataDir = None) -> None:
    """Forget a template: new sandboxes cannot use it; builds that sandboxes, snapshots or
    machines of this data directory use are kept (until ``hangar image gc``)."""
    from hangar.images.template_builder import remove_template

    layout = _layout(data_dir)
    try:
        removed = remove_template(layout, name, pinned_images(layout))
    except HangarError as exc:
        fail(exc)
    out.print(f"removed template {name}" + (f" and {', '.join(removed)}" if removed else ""))
