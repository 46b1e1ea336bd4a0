"""``hangar machine``: per-user machines that sleep when idle."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.table import Table

from hangar.cli.common import out, sdk
from hangar.client import MachineInfo


app = typer.Typer(help="Per-user machines that sleep when idle.", no_args_is_help=True)


def _machine_table(machines: list[MachineInfo]) -> None:
    table = Table("user", "sandbox", "state", "desired", "idle timeout (s)")
    for m in machines:
        table.add_row(m.user_id, m.sandbox_id, m.state, m.desired_state,
                      f"{m.idle_timeout_s:.0f}")
    out.print(table)


@app.command("get")
def machine_get(user_id: str,
                idle: Annotated[Optional[float], typer.Option(help="Idle seconds before sleep.")] = None,
                ) -> None:
    """Get the user's machine, creating it if there is none."""
    with sdk() as h:
        _machine_table([h.get_or_create_machine(user_id, idle_timeout=idle)])


@app.command("ls")
def machine_ls() -> None:
    """List users' machines."""
    with sdk() as h:
        _machine_table(h.list_machines())


@app.command("show")
def machine_show(user_id: str) -> None:
    """Show the machine's state without changing it."""
    with sdk() as h:
        _machine_table([h.get_machine(user_id)])


@app.command("sleep")
def machine_sleep(user_id: str) -> None:
    """Snapshot the machine and stop its VM."""
    with sdk() as h:
        _machine_table([h.sleep_machine(user_id)])


@app.command("wake")
def machine_wake(user_id: str) -> None:
    """Restore the machine from its sleep snapshot."""
    with sdk() as h:
        _machine_table([h.wake_machine(user_id)])


@app.command("rm")
def machine_rm(user_id: str) -> None:
    """Remove the machine and everything it held."""
    with sdk() as h:
        h.delete_machine(user_id)
    out.print(f"removed the machine of {user_id}")
