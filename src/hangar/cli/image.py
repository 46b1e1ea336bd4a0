"""``hangar image build|ls|gc``: guest images built from recipes on this host's disk."""

from __future__ import annotations

import time
from typing import Annotated

import typer
from rich.table import Column, Table

from hangar.cli.common import DataDir, build_recipe, fail, out, pinned_images, server_settings
from hangar.errors import HangarError


app = typer.Typer(help="Build, list and collect guest images.", no_args_is_help=True)


@app.command("build")
def image_build(
    recipe: Annotated[str, typer.Argument(help="Recipe name.")] = "base",
    force: Annotated[bool, typer.Option(
        help="Make a new build even if one of this recipe exists (a new id; the old "
             "build stays for what was made from it).")] = False,
    snapshot: Annotated[bool, typer.Option(
        help="Then boot it and save its template snapshot, which creates restore "
             "(else the server makes it on the first create).")] = True,
    data_dir: DataDir = None,
) -> None:
    """Build a guest image from a recipe (reused while the recipe is unchanged).

    Prints the build's id (NAME-DIGEST, the digest covering its bytes) and directory.
    """
    from hangar.layout import Layout

    layout = Layout(server_settings(data_dir).data_dir)
    layout.ensure()
    try:
        img = build_recipe(layout, recipe, force, snapshot=snapshot)
    except HangarError as exc:
        fail(exc)
    out.print(f"{img.id} {img.dir}")


@app.command("ls")
def image_ls(data_dir: DataDir = None) -> None:
    """List built images."""
    from hangar.images import list_images
    from hangar.layout import Layout

    table = Table("rootfs (MiB)", "kernel", "built", "state")
    table.columns.insert(0, Column("id", no_wrap=True, overflow="fold"))
    for i in list_images(Layout(server_settings(data_dir).data_dir)):
        state = "current" if i.current else ("stale" if i.stale else "")
        table.add_row(i.id, f"{i.rootfs_bytes / 2**20:.0f}", i.kernel_version,
                      time.strftime("%Y-%m-%d %H:%M", time.localtime(i.built_at)), state)
    out.print(table)


@app.command("gc")
def image_gc(
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Only list the builds that would be removed.")] = False,
    data_dir: DataDir = None,
) -> None:
    """Remove image builds that nothing uses: never the current build of a recipe, one a
    sandbox, snapshot or machine of this data dir was made from, or one a VM has open."""
    from hangar.images.gc import collect
    from hangar.layout import Layout

    layout = Layout(server_settings(data_dir).data_dir)
    try:
        result = collect(layout, pinned_images(layout), dry_run=dry_run)
    except HangarError as exc:
        fail(exc)
    verb = "would remove" if dry_run else "removed"
    for i in result.removed:
        out.print(f"{verb} {i.id} ({i.bytes_on_disk / 2**20:.0f} MiB)")
    for k in result.kept:
        out.print(f"kept {k.image.id} ({k.reason})")
    for d in result.leftovers:
        out.print(f"{verb} leftover {d.name}")
    out.print(f"{verb} {len(result.removed)} build(s), "
              f"{result.freed_bytes / 2**20:.0f} MiB")
