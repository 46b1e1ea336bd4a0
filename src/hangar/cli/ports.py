"""``hangar port``: guest TCP ports exposed over HTTP and WebSockets."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.table import Column, Table

from hangar.cli.common import out, sdk


app = typer.Typer(help="Guest TCP ports reached over HTTP and WebSockets.",
                  no_args_is_help=True)


@app.command("expose")
def port_expose(sandbox_id: str, port: int,
                public: Annotated[bool, typer.Option(
                    "--public", help="Open to anyone with the URL (default: private).")] = False,
                signed: Annotated[bool, typer.Option(
                    "--signed", help="Print a URL with a token (private ports), for a browser.")]
                = False,
                ttl: Annotated[Optional[float], typer.Option(
                    help="Seconds the signed URL works (server default 3600).")] = None) -> None:
    """Expose a guest TCP port and print its URL."""
    with sdk() as h:
        info = h.expose(sandbox_id, port, public, token_ttl=ttl)
    out.print(info.signed_url if signed and info.signed_url else info.url, soft_wrap=True)


@app.command("ls")
def port_ls(sandbox_id: str) -> None:
    """List a sandbox's exposed ports."""
    with sdk() as h:
        ports = h.ports(sandbox_id)
    table = Table("port", "public")
    table.columns.append(Column("url", no_wrap=True, overflow="fold"))
    for p in ports:
        table.add_row(str(p.port), "yes" if p.public else "no", p.url)
    out.print(table)


@app.command("close")
def port_close(sandbox_id: str, port: int) -> None:
    """Stop exposing a port (its URLs answer 404)."""
    with sdk() as h:
        h.close_port(sandbox_id, port)
    out.print(f"closed port {port} of {sandbox_id}")
