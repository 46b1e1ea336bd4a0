"""``hangar volume``: named volumes that outlive sandboxes (create, ls, resize, rm, fsck,
files, cat), through the SDK; and ``parse_mounts`` for ``hangar create --volume``."""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer
from rich.table import Table

from hangar.cli.common import err, out, sdk

app = typer.Typer(help="Named volumes: ext4 filesystems that outlive sandboxes.",
                  no_args_is_help=True)


def parse_mounts(specs: list[str]) -> dict[str, Any]:
    """``PATH=VOLUME`` or ``PATH=VOLUME:ro`` options as a create's ``volumes``; exits 2 on a
    malformed one."""
    mounts: dict[str, Any] = {}
    for spec in specs:
        path, sep, vol = spec.partition("=")
        if not sep or not path or not vol:
            err.print(f"[red]error:[/red] --volume {spec!r}: give PATH=VOLUME[:ro]")
            raise typer.Exit(2)
        if vol.endswith(":ro"):
            mounts[path] = {"volume": vol[:-3], "read_only": True}
        else:
            mounts[path] = vol
    return mounts


@app.command("create")
def volume_create(name: str, size: Annotated[int, typer.Option(
        "--size", help="Size, MiB (16 to 1048576).")] = 1024) -> None:
    """Make an empty volume and print its id."""
    with sdk() as h:
        vol = h.create_volume(name, size)
    out.print(vol.id)


@app.command("ls")
def volume_ls() -> None:
    """List volumes and the sandboxes holding them."""
    with sdk() as h:
        vols = h.list_volumes()
    table = Table("id", "name", "size (MiB)", "attached")
    for v in vols:
        held = ", ".join(f"{a.sandbox_id}:{a.path}{' (ro)' if a.read_only else ''}"
                         for a in v.attached)
        table.add_row(v.id, v.name, str(v.size_mib), held or "-")
    out.print(table)


@app.command("resize")
def volume_resize(volume: str, size: Annotated[int, typer.Option(
        "--size", help="New size, MiB; volumes only grow.")]) -> None:
    """Grow a volume no sandbox holds."""
    with sdk() as h:
        vol = h.resize_volume(volume, size)
    out.print(f"{vol.id} is {vol.size_mib} MiB")


@app.command("rm")
def volume_rm(volume: str) -> None:
    """Delete a volume and its data (refused while a sandbox holds it)."""
    with sdk() as h:
        h.delete_volume(volume)
    out.print(f"deleted {volume}")


@app.command("fsck")
def volume_fsck(volume: str) -> None:
    """Check and repair a volume's filesystem (e2fsck -f -y) once no sandbox holds it: the
    repair a volume_corrupt error names."""
    with sdk() as h:
        got = h.fsck_volume(volume)
    if got.output:
        out.print(got.output, markup=False, highlight=False)
    out.print(f"{got.id} ({got.name}): "
              f"{'repaired' if got.repaired else 'sound'} (e2fsck exit {got.exit_code})")


@app.command("files")
def volume_files(volume: str, path: Annotated[str, typer.Argument()] = "/") -> None:
    """List a folder of a volume, without a sandbox."""
    with sdk() as h:
        entries = h.volume_files(volume, path)
    table = Table("name", "type", "size", "mode")
    for e in entries:
        table.add_row(e.name, e.type, str(e.size), f"{e.mode:04o}")
    out.print(table)


@app.command("cat")
def volume_cat(volume: str, path: str) -> None:
    """Write a file of a volume to stdout, without a sandbox."""
    with sdk() as h:
        data = h.volume_read(volume, path)
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()
