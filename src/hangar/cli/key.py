"""``hangar key add|rm|ls|rotate``: the server's API keys, changed on this host's disk.

These commands edit ``<data>/api-key`` and ``<data>/api-keys`` directly (see
``hangar.keys``); a running server notices the change on its next request,
with no restart. ``add`` and ``rotate`` print the new key once on stdout
(``KEY=$(hangar key add ci)``); only its SHA-256 is stored for a named key.
``add --team TEAM`` makes a key that acts for that team only (the team must
exist: ``hangar team create``); without ``--team`` a key is an operator key,
which ``ls`` shows as ``-`` in its team column (a team's name never is ``-``, while
a team may be called ``operator``).

In a cluster (``--etcd URLS`` or ``HANGAR_ETCD``, with the client certificate of
``--pki`` or ``HANGAR_ETCD_PKI``, as ``hangar node``), ``add --team``, ``rm`` and
``ls`` act on the cluster's team keys in etcd (``/hangar/keys/``), which every
node accepts at once; the cluster's operator keys are the ones ``hangar cluster
init`` recorded, so ``add`` without ``--team`` and ``rotate`` of a named key are
refused there (``rm`` and ``add`` again replace a team's key).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from hangar.errors import HangarError

app = typer.Typer(help="API keys: add, remove, list and rotate; no restart needed.",
                  no_args_is_help=True)
out = Console()
err = Console(stderr=True, soft_wrap=True)  # a message is never broken mid-sentence

DataDir = Annotated[Optional[Path], typer.Option(help="Data directory (HANGAR_DATA_DIR).")]
Etcd = Annotated[Optional[str], typer.Option(
    "--etcd", help="A cluster's etcd URLs (HANGAR_ETCD): act on its team keys in etcd.")]
Pki = Annotated[Optional[Path], typer.Option(
    "--pki", help="Folder with the etcd client certificate (HANGAR_ETCD_PKI).")]


def _cluster(urls: str | None) -> str | None:
    """The etcd URLs when the command acts on a cluster (``--etcd`` or ``HANGAR_ETCD``)."""
    return urls or os.environ.get("HANGAR_ETCD") or None


def _in_cluster(urls: str, pki: Path | None, call: object) -> object:
    """Run ``call(etcd)`` (a coroutine function of ``hangar.cluster.teams``) on the cluster's
    etcd; an error is printed and exits 1."""
    from hangar.cli.cluster import _etcd, _run

    etcd = _etcd(urls, pki)

    async def go() -> object:
        try:
            return await call(etcd)  # type: ignore[operator]
        finally:
            await etcd.close()
    return _run(go())


def _store(data_dir: Path | None):  # type: ignore[no-untyped-def]
    from hangar.config import Settings
    from hangar.keys import KeyStore
    from hangar.layout import Layout

    layout = Layout(data_dir if data_dir is not None else Settings().data_dir)
    if not layout.root.is_dir():
        err.print(f"[red]error:[/red] no data directory at {layout.root}; set HANGAR_DATA_DIR "
                  "or --data-dir")
        raise typer.Exit(1)
    return KeyStore(layout.api_key_file, layout.api_keys_file)


def _fail(exc: HangarError | OSError) -> None:
    if isinstance(exc, OSError):
        where = f" {exc.filename}" if exc.filename else ""
        err.print(f"[red]error:[/red] cannot change{where}: {exc.strerror}; run this as the "
                  "owner of the data directory (usually root)")
    else:
        from rich.markup import escape

        err.print(f"[red]error:[/red] {escape(exc.message)}", highlight=False)
    raise typer.Exit(1)


E2B = Annotated[bool, typer.Option(
    "--e2b", help="Make the key in E2B's format (e2b_ and 40 hex digits), for programs "
                  "written for E2B's SDKs (E2B_API_KEY).")]


OPERATOR = "-"
"""What ``ls`` shows in the team column of an operator key (no team): not a team name."""


@app.command("add")
def add(name: Annotated[str, typer.Argument(help="A name for the key, e.g. ci or alice.")],
        team: Annotated[Optional[str], typer.Option(
            help="The team the key acts for (see `hangar team`); without it, an operator "
                 "key, which sees everything.")] = None,
        e2b: E2B = False, data_dir: DataDir = None, etcd: Etcd = None, pki: Pki = None) -> None:
    """Make a named key and print it (shown once; only its hash is kept)."""
    urls = _cluster(etcd)
    if urls:
        if team is None:
            err.print("[red]error:[/red] a cluster's operator keys are those `hangar cluster "
                      "init` recorded; keys added here act for a team: give --team TEAM")
            raise typer.Exit(2)
        from hangar.cluster.teams import add_key

        key = _in_cluster(urls, pki, lambda e: add_key(e, name, team, e2b))
        print(key)
        err.print(f"key {name!r} of team {team!r} added to the cluster; it is shown only now")
        return
    store = _store(data_dir)
    try:
        key = store.add(name, e2b=e2b, team=team)
    except (HangarError, OSError) as exc:
        _fail(exc)
    print(key)
    who = f"of team {team!r}" if team is not None else "(an operator key)"
    err.print(f"key {name!r} {who} added to {store.named_file}; it is shown only now")


@app.command("rm")
def rm(name: str, data_dir: DataDir = None, etcd: Etcd = None, pki: Pki = None) -> None:
    """Remove a named key; it stops working on the server's next request."""
    urls = _cluster(etcd)
    if urls:
        from hangar.cluster.teams import remove_key

        _in_cluster(urls, pki, lambda e: remove_key(e, name))
        err.print(f"key {name!r} removed from the cluster")
        return
    store = _store(data_dir)
    try:
        store.remove(name)
    except (HangarError, OSError) as exc:
        _fail(exc)
    err.print(f"key {name!r} removed")


@app.command("rotate")
def rotate(name: Annotated[str, typer.Argument(help="The key to replace.")] = "default",
           e2b: E2B = False, data_dir: DataDir = None, etcd: Etcd = None) -> None:
    """Replace a key with a new one and print it; the old one stops working at once."""
    if _cluster(etcd) and name != "default":
        err.print("[red]error:[/red] a cluster's team keys are replaced with `hangar key rm "
                  "NAME` and `hangar key add NAME --team TEAM`")
        raise typer.Exit(2)
    store = _store(data_dir)
    try:
        key = store.rotate(name, e2b=e2b)
    except (HangarError, OSError) as exc:
        _fail(exc)
    print(key)
    where = store.default_file if name == "default" else store.named_file
    err.print(f"key {name!r} replaced in {where}")


@app.command("ls")
def ls(data_dir: DataDir = None, etcd: Etcd = None, pki: Pki = None) -> None:
    """List the keys: name, team ("-": operator), fingerprint, creation time, file.

    Never the key itself; in a cluster, its team keys in etcd."""
    urls = _cluster(etcd)
    if urls:
        from hangar.cluster.teams import key_rows, list_keys

        rows = _in_cluster(urls, pki, lambda e: list_keys(e))
        table = Table("name", "team", "fingerprint", "created")
        for name, fp, created, team in key_rows(rows):  # type: ignore[arg-type]
            table.add_row(name, team, fp,
                          time.strftime("%Y-%m-%d %H:%M", time.localtime(created)))
        out.print(table)
        return
    store = _store(data_dir)
    try:
        entries = store.entries()
    except (HangarError, OSError) as exc:
        _fail(exc)
    table = Table("name", "team", "fingerprint", "created", "file")
    for name, fp, created, where, team in entries:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(created)) if created else ""
        table.add_row(name, team or OPERATOR, fp, when, where)
    out.print(table)
