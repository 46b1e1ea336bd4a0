"""``hangar cluster init`` and ``hangar node join|ls|drain|undrain|rm`` (operator commands).

They talk to etcd directly (``--etcd`` or ``HANGAR_ETCD``), so they work
while no Hangar server runs; ``node join`` runs a server that is a node.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

cluster_app = typer.Typer(help="Set up a cluster of Hangar nodes (docs/cluster.md).",
                          no_args_is_help=True)
node_app = typer.Typer(help="Join, list, drain and remove cluster nodes.", no_args_is_help=True)
out = Console()
err = Console(stderr=True)

EtcdOpt = Annotated[Optional[str], typer.Option(
    "--etcd", help="Comma-separated etcd URLs (HANGAR_ETCD), e.g. http://10.0.0.1:2379,...")]


def _etcd(urls: str | None):  # type: ignore[no-untyped-def]
    from hangar.cluster.etcd import Etcd

    urls = urls or os.environ.get("HANGAR_ETCD")
    if not urls:
        err.print("[red]error:[/red] give --etcd URLS or set HANGAR_ETCD")
        raise typer.Exit(2)
    return Etcd(Etcd.parse_urls(urls))


def _run(coro: Any) -> Any:
    from hangar.errors import HangarError

    try:
        return asyncio.run(coro)
    except HangarError as exc:
        err.print(f"[red]error:[/red] {exc.message}", highlight=False)
        raise typer.Exit(1) from None


@cluster_app.command("init")
def init(
    store: Annotated[str, typer.Option(help="Shared snapshot storage: s3://bucket/prefix?"
                                            "endpoint=http://host:9000 or file:///path.")],
    etcd: EtcdOpt = None,
    key_file: Annotated[Path, typer.Option(
        help="The cluster's API key: read from this file, or generated into it (0600).")]
    = Path("/var/lib/hangar/api-key"),
    lease_ttl: Annotated[int, typer.Option(help="Nodes' lease, seconds.")] = 5,
    failover_after: Annotated[float, typer.Option(
        help="Seconds after a lease expired before its sandboxes are handed on.")] = 3.0,
    force: Annotated[bool, typer.Option(help="Overwrite an existing cluster's settings.")]
    = False,
) -> None:
    """Write the cluster's shared settings to etcd and make the store's bucket or folder."""
    from hangar import keys as K
    from hangar.cluster import records as R
    from hangar.cluster.etcd import cmp_version, op_put
    from hangar.cluster.records import ClusterConfig
    from hangar.cluster.storage import open_store

    if key_file.exists():
        key = K.read_default(key_file)
        if key is None:
            err.print(f"[red]error:[/red] {key_file} holds no key")
            raise typer.Exit(1)
    else:
        key = K.create_default(key_file)
        err.print(f"API key generated into {key_file} (give it to your clients)")
    cfg = ClusterConfig(store=store, key_hashes=[hashlib.sha256(key.encode()).hexdigest()],
                        node_token=secrets.token_urlsafe(32), lease_ttl_s=lease_ttl,
                        failover_after_s=failover_after)

    async def go() -> bool:
        client = _etcd(etcd)
        try:
            await open_store(store).ensure()
            compare = [] if force else [cmp_version(R.CONFIG, 0)]
            ok, _ = await client.txn(compare, [op_put(R.CONFIG, cfg.to_json())])
            return ok
        finally:
            await client.close()

    if not _run(go()):
        err.print("[red]error:[/red] this etcd already holds a Hangar cluster (use --force "
                  "to replace its settings)")
        raise typer.Exit(1)
    out.print(f"cluster ready: store {store}; nodes join with `hangar node join --etcd ... "
              f"--advertise HOST:PORT`")


@node_app.command("join")
def join(
    etcd: EtcdOpt = None,
    advertise: Annotated[Optional[str], typer.Option(
        help="host:port other nodes reach this node's API at (HANGAR_ADVERTISE).")] = None,
    name: Annotated[Optional[str], typer.Option(help="Node name (default: host name).")]
    = None,
    host: Annotated[Optional[str], typer.Option(help="Listen address (HANGAR_HOST).")] = None,
    port: Annotated[Optional[int], typer.Option(help="Listen port (HANGAR_PORT).")] = None,
    data_dir: Annotated[Optional[Path], typer.Option(help="Data directory.")] = None,
) -> None:
    """Run this host's Hangar server as a node of the cluster."""
    urls = etcd or os.environ.get("HANGAR_ETCD")
    if not urls:
        err.print("[red]error:[/red] give --etcd URLS or set HANGAR_ETCD")
        raise typer.Exit(2)
    os.environ["HANGAR_ETCD"] = urls
    for var, value in (("HANGAR_ADVERTISE", advertise), ("HANGAR_NODE_NAME", name)):
        if value:
            os.environ[var] = value
    from hangar.cli.serve import serve

    serve(host=host, port=port, data_dir=data_dir, engine=None, accel=None)


async def _nodes(client: Any) -> tuple[dict[str, Any], set[str], dict[str, int], set[str]]:
    from hangar.cluster import records as R

    kvs, _ = await client.get_prefix(R.ROOT)
    nodes, drained, used, named = {}, set(), {}, set()
    for kv in kvs:
        if kv.key.startswith(R.NODES):
            nodes[kv.key[len(R.NODES):]] = kv.json()
        elif kv.key.startswith(R.DRAIN):
            drained.add(kv.key[len(R.DRAIN):])
        elif kv.key.startswith(R.SLOTS):
            n = kv.key[len(R.SLOTS):].split("/", 1)[0]
            used[n] = used.get(n, 0) + 1
            named.add(n)
        elif kv.key.startswith(R.SANDBOXES):
            owner = (kv.json().get("status") or {}).get("nodeName")
            if owner:
                named.add(owner)
    return nodes, drained, used, named


@node_app.command("ls")
def ls(etcd: EtcdOpt = None,
       as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """List nodes: alive ones (holding their lease) and lost ones still named by records."""
    import json

    async def go() -> list[dict[str, Any]]:
        client = _etcd(etcd)
        try:
            nodes, drained, used, named = await _nodes(client)
        finally:
            await client.close()
        rows = []
        for name in sorted(set(nodes) | named | drained):
            n = nodes.get(name)
            state = "lost" if n is None else ("draining" if name in drained else "ready")
            rows.append({"name": name, "state": state, "address": n and n["address"],
                         "slots_used": used.get(name, 0), "capacity": n and n["capacity"],
                         "engine": n and f"{n['engine']}/{n['accel']}",
                         "images": n and len(n.get("images", []))})
        return rows

    rows = _run(go())
    if as_json:
        out.print_json(json.dumps(rows))
        return
    t = Table("node", "state", "address", "slots", "engine", "images")
    for r in rows:
        t.add_row(r["name"], r["state"], r["address"] or "-",
                  f"{r['slots_used']}/{r['capacity'] if r['capacity'] is not None else '?'}",
                  r["engine"] or "-", str(r["images"] or "-"))
    out.print(t)


@node_app.command("drain")
def drain(name: str, etcd: EtcdOpt = None) -> None:
    """Place nothing new on NAME; its sleeping machines wake elsewhere on their next call."""
    from hangar.cluster import records as R

    async def go() -> None:
        client = _etcd(etcd)
        try:
            await client.put(R.DRAIN + name, "1")
        finally:
            await client.close()

    _run(go())
    out.print(f"node {name} drained")


@node_app.command("undrain")
def undrain(name: str, etcd: EtcdOpt = None) -> None:
    """Let NAME take new sandboxes again."""
    from hangar.cluster import records as R

    async def go() -> None:
        client = _etcd(etcd)
        try:
            await client.delete(R.DRAIN + name)
        finally:
            await client.close()

    _run(go())
    out.print(f"node {name} takes new sandboxes again")


@node_app.command("rm")
def rm(name: str, etcd: EtcdOpt = None,
       force: Annotated[bool, typer.Option(help="Also when the node still holds its lease.")]
       = False) -> None:
    """Forget a node: its drain flag and VM slots. Refused while it is alive (unless --force)."""
    from hangar.cluster import records as R

    async def go() -> bool:
        client = _etcd(etcd)
        try:
            if await client.get(R.node_key(name)) is not None and not force:
                return False
            await client.delete(R.DRAIN + name)
            await client.delete(f"{R.SLOTS}{name}/", prefix=True)
            if force:
                await client.delete(R.node_key(name))
            return True
        finally:
            await client.close()

    if not _run(go()):
        err.print(f"[red]error:[/red] node {name} is alive (it holds its lease); stop it "
                  "first, or use --force")
        raise typer.Exit(1)
    out.print(f"node {name} removed")
