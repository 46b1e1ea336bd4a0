"""``hangar secret``: the vault (add, rotate, ls, rm), through the SDK; and ``parse_secrets``
for ``hangar create --secret``. A value is read from stdin or a hidden prompt, never from
the command line (where ``ps`` and shell history would show it)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.table import Table

from hangar.cli.common import err, out, sdk

app = typer.Typer(help="The vault: secrets sandboxes use without holding them.",
                  no_args_is_help=True)

Hosts = Annotated[list[str], typer.Option(
    "--host", help="A host it may be sent to (a name, or '*.' and a name); repeat for more.")]


def read_value() -> str:
    """The secret's value: stdin when it is not a terminal (one line, or all of it without
    its last newline), else a hidden prompt."""
    if sys.stdin.isatty():
        return typer.prompt("value", hide_input=True)
    value = sys.stdin.read()
    return value[:-1] if value.endswith("\n") else value


def parse_secrets(specs: list[str]) -> dict[str, str]:
    """``ENV=NAME`` options as a create's ``secrets``; exits 2 on a malformed one."""
    out_: dict[str, str] = {}
    for spec in specs:
        var, sep, name = spec.partition("=")
        if not sep or not var or not name:
            err.print(f"[red]error:[/red] --secret {spec!r}: give ENV=NAME")
            raise typer.Exit(2)
        out_[var] = name
    return out_


@app.command("add")
def secret_add(name: str, host: Hosts) -> None:
    """Store a secret (its value from stdin or a hidden prompt) for the --host hosts."""
    value = read_value()
    with sdk() as h:
        s = h.create_secret(name, value, host)
    out.print(f"{s.name}: {', '.join(s.hosts)}")


@app.command("rotate")
def secret_rotate(name: str, host: Annotated[list[str] | None, typer.Option(
        "--host", help="New hosts (default: keep them).")] = None) -> None:
    """Give a secret a new value (from stdin or a hidden prompt)."""
    value = read_value()
    with sdk() as h:
        s = h.rotate_secret(name, value, host or None)
    out.print(f"{s.name}: {', '.join(s.hosts)}")


@app.command("ls")
def secret_ls() -> None:
    """List secrets: names and hosts, never values."""
    with sdk() as h:
        got = h.list_secrets()
    table = Table("name", "hosts")
    for s in got:
        table.add_row(s.name, ", ".join(s.hosts))
    out.print(table)


@app.command("rm")
def secret_rm(name: str) -> None:
    """Delete a secret; sandboxes given it get its placeholder refused from then on."""
    with sdk() as h:
        h.delete_secret(name)
