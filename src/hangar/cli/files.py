"""``hangar files``: copy files in and out of a sandbox, list, remove, make directories."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from hangar.cli.common import err, out, sdk


app = typer.Typer(help="Copy files in and out of a sandbox.", no_args_is_help=True)


@app.command("put")
def files_put(sandbox_id: str, local: Path, remote: str,
              mode: Annotated[Optional[str], typer.Option(help="Octal mode, e.g. 755.")] = None) -> None:
    """Copy a local file into the sandbox."""
    try:
        data = local.read_bytes()
    except OSError as exc:
        err.print(f"[red]error:[/red] cannot read {local}: {exc.strerror or exc}")
        raise typer.Exit(1) from None
    with sdk() as h:
        r = h.write_file(sandbox_id, remote, data, int(mode, 8) if mode else 0o644)
    out.print(f"{r.path}: {r.size} bytes")


@app.command("get")
def files_get(sandbox_id: str, remote: str,
              local: Annotated[Optional[Path], typer.Argument(help="Default: stdout.")] = None) -> None:
    """Copy a file out of the sandbox (to stdout when no local path is given)."""
    with sdk() as h:
        data = h.read_file(sandbox_id, remote)
    if local is None or str(local) == "-":
        sys.stdout.buffer.write(data)
    else:
        local.write_bytes(data)


@app.command("ls")
def files_ls(sandbox_id: str,
             path: Annotated[str, typer.Argument(help="Directory in the guest.")] = "/root") -> None:
    """List a directory in the sandbox."""
    with sdk() as h:
        entries = h.list_files(sandbox_id, path)
    table = Table("name", "type", "size", "mode")
    for e in entries:
        table.add_row(e.name, e.type, str(e.size), oct(e.mode))
    out.print(table)


@app.command("rm")
def files_rm(sandbox_id: str, path: str,
             recursive: Annotated[bool, typer.Option("-r", "--recursive")] = False) -> None:
    """Remove a file (or, with -r, a directory) in the sandbox."""
    with sdk() as h:
        h.remove_file(sandbox_id, path, recursive)


@app.command("mkdir")
def files_mkdir(sandbox_id: str, path: str) -> None:
    """Create a directory (and its parents) in the sandbox."""
    with sdk() as h:
        h.make_dir(sandbox_id, path)
