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
    "--etcd", help="Comma-separated etcd URLs (HANGAR_ETCD), e.g. https://10.0.0.1:2379,...")]
PkiOpt = Annotated[Optional[Path], typer.Option(
    "--pki", help="Folder with ca.crt, node.crt, node.key (HANGAR_ETCD_PKI; default: "
                  "DATA_DIR/etcd-pki), made by `hangar cluster certs`.")]


def _pki(folder: Path | None) -> Path:
    if folder is not None:
        return folder
    env = os.environ.get("HANGAR_ETCD_PKI")
    if env:
        return Path(env)
    return Path(os.environ.get("HANGAR_DATA_DIR") or "/var/lib/hangar") / "etcd-pki"


def _etcd(urls: str | None, pki: Path | None = None):  # type: ignore[no-untyped-def]
    from hangar.cluster.etcd import Etcd
    from hangar.cluster.pki import tls_from
    from hangar.errors import ConfigError

    urls = urls or os.environ.get("HANGAR_ETCD")
    if not urls:
        err.print("[red]error:[/red] give --etcd URLS or set HANGAR_ETCD")
        raise typer.Exit(2)
    eps = Etcd.parse_urls(urls)
    if any(not u.startswith("https://") for u in eps):
        err.print("[red]error:[/red] etcd is reached over TLS only: give https:// URLs "
                  "(docs/cluster.md)")
        raise typer.Exit(2)
    try:
        return Etcd(eps, tls=tls_from(_pki(pki)).context())
    except ConfigError as exc:
        err.print(f"[red]error:[/red] {exc.message}", highlight=False)
        raise typer.Exit(2) from None


def _node_name(name: str) -> str:
    from hangar.cluster.records import NODE_NAME

    if not NODE_NAME.fullmatch(name):
        err.print(f"[red]error:[/red] bad node name {name!r} (letters, digits, '.', '_', '-')",
                  highlight=False)
        raise typer.Exit(2)
    return name


def _run(coro: Any) -> Any:
    from hangar.errors import HangarError

    try:
        return asyncio.run(coro)
    except HangarError as exc:
        err.print(f"[red]error:[/red] {exc.message}", highlight=False)
        raise typer.Exit(1) from None


@cluster_app.command("certs")
def certs(
    nodes: Annotated[str, typer.Option(
        help="Every node and the address of its etcd member: n1=10.0.0.1,n2=10.0.0.2,...")],
    folder: Annotated[Path, typer.Option(
        "--out", help="Folder to write the CA and one folder per node into (0700; files "
                      "0600).")] = Path("/etc/hangar/etcd-pki"),
) -> None:
    """Make the cluster's CA, a server certificate per etcd member and a client certificate
    per node (docs/cluster.md). An existing CA in OUT is kept and signs the new ones."""
    from hangar.cluster.pki import make
    from hangar.errors import ConfigError

    members = []
    for item in nodes.split(","):
        name, sep, ip = item.strip().partition("=")
        if not sep:
            err.print(f"[red]error:[/red] {item!r} is not NAME=ADDRESS")
            raise typer.Exit(2)
        members.append((name, ip))
    try:
        folders = make(folder, members)
    except ConfigError as exc:
        err.print(f"[red]error:[/red] {exc.message}", highlight=False)
        raise typer.Exit(2) from None
    err.print(f"CA and certificates written under {folder}: copy {folder}/<node>/ to each "
              "host (its etcd's files and HANGAR_ETCD_PKI); keep ca.key on none of them")
    for d in folders:
        out.print(f"{d.name}: {d}")


@cluster_app.command("init")
def init(
    store: Annotated[str, typer.Option(help="Shared snapshot storage: s3://bucket/prefix?"
                                            "endpoint=http://host:9000 or file:///path.")],
    etcd: EtcdOpt = None,
    pki: PkiOpt = None,
    key_file: Annotated[Path, typer.Option(
        help="The cluster's API key: read from this file, or generated into it (0600).")]
    = Path("/var/lib/hangar/api-key"),
    lease_ttl: Annotated[int, typer.Option(help="Nodes' lease, seconds.")] = 5,
    failover_after: Annotated[float, typer.Option(
        help="Seconds after a lease expired before its sandboxes are handed on.")] = 3.0,
    restart_grace: Annotated[int, typer.Option(
        help="Seconds the failover waits instead for a node that stopped gracefully (a "
             "restart; its VMMs run on). 0: no grace.")] = 60,
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
    try:
        cfg = ClusterConfig.parse({
            "store": store, "key_hashes": [hashlib.sha256(key.encode()).hexdigest()],
            "node_token": secrets.token_urlsafe(32), "lease_ttl_s": lease_ttl,
            "failover_after_s": failover_after, "restart_grace_s": restart_grace})
    except R.BadRecord as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False, markup=False)
        raise typer.Exit(2) from None

    async def go() -> bool:
        client = _etcd(etcd, pki)
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
    pki: PkiOpt = None,
) -> None:
    """Run this host's Hangar server as a node of the cluster."""
    urls = etcd or os.environ.get("HANGAR_ETCD")
    if not urls:
        err.print("[red]error:[/red] give --etcd URLS or set HANGAR_ETCD")
        raise typer.Exit(2)
    os.environ["HANGAR_ETCD"] = urls
    for var, value in (("HANGAR_ADVERTISE", advertise), ("HANGAR_NODE_NAME", name),
                       ("HANGAR_ETCD_PKI", str(pki) if pki else None)):
        if value:
            os.environ[var] = value
    from hangar.cli.serve import serve

    serve(host=host, port=port, data_dir=data_dir, engine=None, accel=None)


async def _nodes(client: Any) -> tuple[dict[str, Any], set[str], dict[str, int], set[str],
                                       set[str]]:
    """(nodes by name, drained, slots used by node, nodes named by records, restart marks)."""
    from hangar.cluster import records as R

    kvs, _ = await client.get_prefix(R.ROOT)
    nodes, drained, used, named, restarting = {}, set(), {}, set(), set()
    for kv in kvs:  # read as untrusted, as the nodes read it: malformed keys are skipped
        try:
            if kv.key.startswith(R.NODES):
                name = R.key_id(kv.key, R.NODES, R.NODE_NAME)
                nodes[name] = R.NodeInfo.parse(R.load_json(kv.value)).to_json()
            elif kv.key.startswith(R.DRAIN):
                drained.add(R.key_id(kv.key, R.DRAIN, R.NODE_NAME))
            elif kv.key.startswith(R.RESTARTS):
                restarting.add(R.key_id(kv.key, R.RESTARTS, R.NODE_NAME))
            elif kv.key.startswith(R.SLOTS):
                n = kv.key[len(R.SLOTS):].split("/", 1)[0]
                if R.NODE_NAME.fullmatch(n):
                    used[n] = used.get(n, 0) + 1
                    named.add(n)
            elif kv.key.startswith(R.SANDBOXES):
                sid = R.key_id(kv.key, R.SANDBOXES, R.SANDBOX_ID)
                owner = R.SandboxObject.parse(R.load_json(kv.value), sid=sid).node
                if owner:
                    named.add(owner)
        except R.BadRecord as exc:
            err.print(f"skipped {kv.key[:120]!r}: {exc}", highlight=False, markup=False)
    return nodes, drained, used, named, restarting


@node_app.command("ls")
def ls(etcd: EtcdOpt = None, pki: PkiOpt = None,
       as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """List nodes: alive ones (holding their lease) and lost ones still named by records
    (``restarting`` while a lost one's restart mark lasts)."""
    import json

    async def go() -> list[dict[str, Any]]:
        client = _etcd(etcd, pki)
        try:
            nodes, drained, used, named, restarting = await _nodes(client)
        finally:
            await client.close()
        rows = []
        for name in sorted(set(nodes) | named | drained):
            n = nodes.get(name)
            if n is None:
                state = "restarting" if name in restarting else "lost"
            else:
                state = "draining" if name in drained else "ready"
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
def drain(name: str, etcd: EtcdOpt = None, pki: PkiOpt = None) -> None:
    """Place nothing new on NAME; its sleeping machines wake elsewhere on their next call."""
    from hangar.cluster import records as R

    _node_name(name)
    async def go() -> None:
        client = _etcd(etcd, pki)
        try:
            await client.put(R.DRAIN + name, "1")
        finally:
            await client.close()

    _run(go())
    out.print(f"node {name} drained")


@node_app.command("undrain")
def undrain(name: str, etcd: EtcdOpt = None, pki: PkiOpt = None) -> None:
    """Let NAME take new sandboxes again."""
    from hangar.cluster import records as R

    _node_name(name)
    async def go() -> None:
        client = _etcd(etcd, pki)
        try:
            await client.delete(R.DRAIN + name)
        finally:
            await client.close()

    _run(go())
    out.print(f"node {name} takes new sandboxes again")


@node_app.command("rm")
def rm(name: str, etcd: EtcdOpt = None, pki: PkiOpt = None,
       force: Annotated[bool, typer.Option(help="Also when the node still holds its lease.")]
       = False) -> None:
    """Forget a node: its drain flag, restart mark and VM slots. Refused while it is alive
    (unless --force)."""
    from hangar.cluster import records as R

    _node_name(name)
    async def go() -> bool:
        client = _etcd(etcd, pki)
        try:
            if await client.get(R.node_key(name)) is not None and not force:
                return False
            await client.delete(R.DRAIN + name)
            await client.delete(R.restart_key(name))
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
