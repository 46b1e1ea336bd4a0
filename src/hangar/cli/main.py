"""The ``hangar`` app (typer + rich): where every command and group is registered.

Server side: ``hangar serve``, ``hangar image build|ls|gc`` (``image``),
``hangar template build|import|ls|rm`` (``template``), ``hangar doctor`` and
``hangar bench boot`` (``host``), ``hangar key``, ``hangar mcp`` (``mcp``: the
agent tools of ``hangar.tools`` over MCP), ``hangar cluster``/``node``,
``hangar deploy``/``backup`` (``ops``).
Client side (talks to a server at ``HANGAR_URL`` with ``HANGAR_API_KEY`` or
the key file), through the public SDK (``hangar.client``) only: ``create``,
``ls``, ``exec``, ``shell``, ``rm``, ``ttl``, ``events`` (``sandbox``),
``status``, ``files``, ``snapshot``, ``volume``, ``machine``, ``desktop``, ``port``
(``ports``), ``team`` (operator key only).
Errors print one line and exit 1; ``exec`` exits with the command's code.
"""

from __future__ import annotations

import typer

from hangar.cli import (desktop, files, image, machine, ops, ports, sandbox, secret, snapshot,
                        volume)
from hangar.cli.cluster import cluster_app, node_app
from hangar.cli.host import bench_app, doctor
from hangar.cli.key import app as key_app
from hangar.cli.mcp import mcp
from hangar.cli.serve import serve
from hangar.cli.status import status
from hangar.cli.team import app as team_app
from hangar.cli.template import app as template_app

app = typer.Typer(help="Hangar: microVM sandboxes for AI agents.", no_args_is_help=True,
                  pretty_exceptions_enable=False)

_ONE_COMMAND = {"allow_interspersed_args": False}
"""``exec`` and ``shell``: everything after the sandbox id is the guest's command."""

app.command()(sandbox.create)
app.command("ls")(sandbox.ls)
app.command("exec", context_settings=_ONE_COMMAND)(sandbox.exec_)
app.command(context_settings=_ONE_COMMAND)(sandbox.shell)
app.command()(sandbox.rm)
app.command()(sandbox.ttl)
app.command()(sandbox.network)
app.command()(sandbox.events)
app.command()(serve)
app.command()(status)
app.command()(doctor)
app.command()(mcp)
app.command("backup")(ops.backup)

app.add_typer(image.app, name="image")
app.add_typer(files.app, name="files")
app.add_typer(machine.app, name="machine")
app.add_typer(snapshot.app, name="snapshot")
app.add_typer(volume.app, name="volume")
app.add_typer(secret.app, name="secret")
app.add_typer(desktop.app, name="desktop")
app.add_typer(ports.app, name="port")
app.add_typer(bench_app, name="bench")
app.add_typer(key_app, name="key")
app.add_typer(team_app, name="team")
app.add_typer(template_app, name="template")
app.add_typer(cluster_app, name="cluster")
app.add_typer(node_app, name="node")
app.add_typer(ops.deploy_app, name="deploy")
