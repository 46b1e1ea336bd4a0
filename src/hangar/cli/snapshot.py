"""``hangar snapshot``: snapshots of running sandboxes, restores and forks."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.table import Table

from hangar.cli.common import out, sdk


app = typer.Typer(help="Snapshots of running sandboxes.", no_args_is_help=True)


@app.command("create")
def snapshot_create(sandbox_id: str) -> None:
    """Snapshot a running sandbox and print the snapshot's id."""
    with sdk() as h:
        snap = h.snapshot(sandbox_id)
    out.print(f"{snap.id} ({snap.size_bytes / 2**20:.1f} MiB)")


@app.command("ls")
def snapshot_ls(sandbox: Annotated[Optional[str], typer.Option(help="Only this sandbox's.")] = None,
                ) -> None:
    """List snapshots."""
    with sdk() as h:
        snaps = h.list_snapshots(sandbox)
    table = Table("id", "sandbox", "size (MiB)", "memory (MiB)")
    for s in snaps:
        table.add_row(s.id, s.sandbox_id, f"{s.size_bytes / 2**20:.1f}", str(s.memory_mib))
    out.print(table)


@app.command("restore")
def snapshot_restore(sandbox_id: str, snapshot_id: str) -> None:
    """Bring a sandbox back to one of its snapshots."""
    with sdk() as h:
        h.restore(sandbox_id, snapshot_id)
    out.print(f"{sandbox_id} restored to {snapshot_id}")


@app.command("fork")
def snapshot_fork(snapshot_id: str) -> None:
    """Start a new sandbox from a snapshot and print its id."""
    with sdk() as h:
        sb = h.fork(snapshot_id)
    out.print(sb.id)


@app.command("rm")
def snapshot_rm(snapshot_id: str) -> None:
    """Delete a snapshot."""
    with sdk() as h:
        h.delete_snapshot(snapshot_id)
    out.print(f"deleted {snapshot_id}")
