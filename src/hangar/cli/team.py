"""``hangar team create|ls|set|rm``: teams and their limits, through the SDK (``/teams``).

These commands talk to the server (in a cluster: any node, whose gateway keeps the
teams in etcd, ``hangar.cluster.team_routes``) with the key the CLI already uses
(``HANGAR_API_KEY`` or ``<data>/api-key``), which must be an operator key: a
team's key gets 403. A team's keys are made on the server's host with
``hangar key add NAME --team TEAM``. A limit left out, or removed with
``set --no-max-...``, is no limit.
"""

from __future__ import annotations

import time
from typing import Annotated, Optional

import typer
from rich.table import Table

from hangar.cli.common import err, out, sdk

app = typer.Typer(help="Teams: the owners of keys and sandboxes, and their limits "
                       "(operator key only).", no_args_is_help=True)


def _max(flag: str, what: str):  # type: ignore[no-untyped-def]
    return Annotated[Optional[int], typer.Option(flag, min=0, help=f"Limit on {what}.")]


MaxSandboxes = _max("--max-sandboxes", "live sandboxes at once")
MaxVcpus = _max("--max-vcpus", "vCPUs of its live sandboxes together")
MaxMemory = _max("--max-memory-mib", "memory of its live sandboxes together, MiB")
MaxDisk = _max("--max-disk-mib", "disk of its sandboxes together, MiB")
MaxVolumes = _max("--max-volumes-mib", "size of its named volumes together, MiB")


def _no(flag: str):  # type: ignore[no-untyped-def]
    return Annotated[bool, typer.Option(flag, help="Remove this limit.")]


NoMaxSandboxes = _no("--no-max-sandboxes")
NoMaxVcpus = _no("--no-max-vcpus")
NoMaxMemory = _no("--no-max-memory-mib")
NoMaxDisk = _no("--no-max-disk-mib")
NoMaxVolumes = _no("--no-max-volumes-mib")


def _show(limit: int | None) -> str:
    return "-" if limit is None else str(limit)


def _said(team) -> str:  # type: ignore[no-untyped-def]
    """``team``'s limits on one line, e.g. ``max_vcpus=8 max_sandboxes=-``."""
    return " ".join(f"{k}={_show(v)}" for k, v in team.limits().items())


@app.command("create")
def team_create(name: str, max_sandboxes: MaxSandboxes = None, max_vcpus: MaxVcpus = None,
                max_memory_mib: MaxMemory = None, max_disk_mib: MaxDisk = None,
                max_volumes_mib: MaxVolumes = None) -> None:
    """Make a team; limits left out are none. Then: hangar key add NAME --team TEAM."""
    limits = {k: v for k, v in {
        "max_sandboxes": max_sandboxes, "max_vcpus": max_vcpus,
        "max_memory_mib": max_memory_mib, "max_disk_mib": max_disk_mib,
        "max_volumes_mib": max_volumes_mib}.items() if v is not None}
    with sdk() as h:
        team = h.create_team(name, **limits)
    out.print(f"team {team.name}: {_said(team)}", highlight=False)


@app.command("ls")
def team_ls() -> None:
    """List teams: each one's use beside its limit (used / limit; - is no limit)."""
    with sdk() as h:
        teams = h.list_teams()
    table = Table("name", "sandboxes", "vCPUs", "memory (MiB)", "disk (MiB)",
                  "volumes (MiB)", "created")
    for t in teams:
        u = t.usage
        table.add_row(
            t.name, f"{u.sandboxes} / {_show(t.max_sandboxes)}",
            f"{u.vcpus} / {_show(t.max_vcpus)}", f"{u.memory_mib} / {_show(t.max_memory_mib)}",
            f"{u.disk_mib} / {_show(t.max_disk_mib)}",
            f"{u.volumes_mib} / {_show(t.max_volumes_mib)}",
            time.strftime("%Y-%m-%d %H:%M", time.localtime(t.created_at)))
    out.print(table)


@app.command("set")
def team_set(name: str, max_sandboxes: MaxSandboxes = None, max_vcpus: MaxVcpus = None,
             max_memory_mib: MaxMemory = None, max_disk_mib: MaxDisk = None,
             max_volumes_mib: MaxVolumes = None,
             no_max_sandboxes: NoMaxSandboxes = False, no_max_vcpus: NoMaxVcpus = False,
             no_max_memory_mib: NoMaxMemory = False, no_max_disk_mib: NoMaxDisk = False,
             no_max_volumes_mib: NoMaxVolumes = False) -> None:
    """Change a team's limits: --max-X N sets one, --no-max-X removes it; others stay."""
    given = {"max_sandboxes": (max_sandboxes, no_max_sandboxes),
             "max_vcpus": (max_vcpus, no_max_vcpus),
             "max_memory_mib": (max_memory_mib, no_max_memory_mib),
             "max_disk_mib": (max_disk_mib, no_max_disk_mib),
             "max_volumes_mib": (max_volumes_mib, no_max_volumes_mib)}
    limits: dict[str, int | None] = {}
    for k, (value, remove) in given.items():
        flag = "--" + k.replace("_", "-")
        if value is not None and remove:
            err.print(f"[red]error:[/red] give {flag} or --no-{flag[2:]}, not both")
            raise typer.Exit(2)
        if value is not None or remove:
            limits[k] = value
    if not limits:
        err.print("[red]error:[/red] nothing to change: give --max-... N or --no-max-...")
        raise typer.Exit(2)
    with sdk() as h:
        team = h.update_team(name, **limits)
    out.print(f"team {team.name}: {_said(team)}", highlight=False)


@app.command("rm")
def team_rm(name: str) -> None:
    """Delete a team (refused while it holds sandboxes or keys)."""
    with sdk() as h:
        h.delete_team(name)
    out.print(f"deleted team {name}", highlight=False)
