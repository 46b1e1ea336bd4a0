"""The cluster's parts without VMs: the etcd client, claims and untrusted records on a real
etcd, the failover's moves, shared storage on a real folder and a real S3 server (moto's
server mode), all on loopback; and the import rule (no cluster module imports the API)."""

from __future__ import annotations

import ast
import asyncio
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import hangar
import hangar.cluster
from hangar.cluster.directory import Directory
from hangar.cluster.etcd import Etcd, EtcdUnavailable, cmp_version, op_put
from hangar.cluster.failover import Failover, hand_on, landing
from hangar.cluster.membership import Membership
from hangar.cluster.pki import etcd_flags, make, tls_from
from hangar.cluster import team_records as TR
from hangar.cluster.records import BadRecord, NodeInfo, SandboxObject, sandbox_key
from hangar.cluster.storage import FileStore, StorageError, open_store
from hangar.core.lifecycle import Guard, IllegalTransition, State, check
from hangar.cluster.gateway import node_token
from hangar.errors import ConfigError, Conflict, LimitExceeded, NotFound, Unauthorized


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TLS: dict[str, ssl.SSLContext] = {}
PKI: dict[str, Path] = {}


def _client(*urls: str, timeout: float = 2.0) -> Etcd:
    """A client of the test's etcd with node t's certificate (as a node is)."""
    return Etcd(list(urls), timeout=timeout, tls=TLS["t"])


@pytest.fixture(scope="module")
def etcd_url() -> Iterator[str]:
    """One etcd member on loopback, run as a cluster runs it: TLS on both ports and client
    certificates (``hangar.cluster.pki``)."""
    if shutil.which("etcd") is None:
        pytest.skip("needs etcd (apt-get install etcd-server)")
    d = Path(tempfile.mkdtemp(prefix="hg-etcd-"))
    make(d / "pki", [("t", "127.0.0.1"), ("other", "127.0.0.1")])
    PKI["t"] = d / "pki" / "t"
    TLS["t"] = tls_from(PKI["t"]).context()
    client, peer = _port(), _port()
    p = subprocess.Popen(["etcd", "--name", "t", "--data-dir", str(d / "data"),
                          "--listen-client-urls", f"https://127.0.0.1:{client}",
                          "--advertise-client-urls", f"https://127.0.0.1:{client}",
                          "--listen-peer-urls", f"https://127.0.0.1:{peer}",
                          "--initial-advertise-peer-urls", f"https://127.0.0.1:{peer}",
                          "--initial-cluster", f"t=https://127.0.0.1:{peer}",
                          *etcd_flags(PKI["t"])],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"https://127.0.0.1:{client}"
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                asyncio.run(_status(url))
                break
            except EtcdUnavailable:
                time.sleep(0.2)
        yield url
    finally:
        p.kill()
        p.wait()
        shutil.rmtree(d, ignore_errors=True)


async def _status(url: str) -> None:
    e = _client(url)
    try:
        await e.status()
    finally:
        await e.close()


def test_claims_never_overshoot_and_a_dead_endpoint_is_skipped(etcd_url: str) -> None:
    dead = f"https://127.0.0.1:{_port()}"

    async def go() -> None:
        e = _client(dead, etcd_url)  # the first member is down: every call fails over
        d = Directory(e)
        nodes = [NodeInfo(name=f"x{i}", address=f"10.0.0.{i}:8080", capacity=c, free=c,
                          engine="qemu", accel="tcg", cpu_model="", images=[])
                 for i, c in ((1, 1), (2, 2))]

        def record(node: NodeInfo, k: int, sid: str) -> SandboxObject:
            return SandboxObject(name=sid, spec={}, status={"nodeName": node.name, "slot": k,
                                                            "epoch": 1,
                                                            "state": State.CREATING.value})

        async def one(i: int) -> str:
            sid = f"sb-{i:012x}"
            try:
                node, k = await d.claim(sid, nodes, lambda n, k: record(n, k, sid), [],
                                        lambda n: [])
                return f"{node.name}/{k}"
            except LimitExceeded:
                return "429"

        won = await asyncio.gather(*(one(i) for i in range(20)))
        assert sorted(w for w in won if w != "429") == ["x1/0", "x2/0", "x2/1"], won
        kvs, _ = await e.get_prefix("/hangar/slots/")
        assert len(kvs) == 3
        # A compare-and-set that lost a race changes nothing.
        ok, _ = await e.txn([cmp_version("/hangar/slots/x1/0", 0)],
                            [op_put("/hangar/slots/x1/0", "sb-intruder")])
        assert not ok and (await e.get("/hangar/slots/x1/0")).value != b"sb-intruder"
        await e.close()
        gone = _client(dead, timeout=0.5)
        with pytest.raises(EtcdUnavailable) as info:
            await gone.get("/hangar/config")
        assert info.value.status == 503 and info.value.retryable
        await gone.close()

    asyncio.run(go())


def test_file_store_round_trip_and_unfinished_uploads(tmp_path: Path) -> None:
    src = tmp_path / "snap"
    (src / "sub").mkdir(parents=True)
    (src / "state.mig").write_bytes(os.urandom(300_000))
    (src / "sub" / "disk.qcow2").write_bytes(b"disk" * 1000)
    (src / "snapshot.json").write_text('{"format": 1}')
    store = open_store(f"file://{tmp_path / 'shared'}")
    assert isinstance(store, FileStore)

    async def go() -> None:
        await store.ensure()
        sent = await store.upload_dir("snapshots/s1", src, "snapshot.json")
        assert sent == 300_000 + 4000 + len('{"format": 1}')
        dest = tmp_path / "got"
        await store.download_dir("snapshots/s1", dest, "snapshot.json")
        for f in ("state.mig", "sub/disk.qcow2", "snapshot.json"):
            assert (dest / f).read_bytes() == (src / f).read_bytes()
        (tmp_path / "shared" / "snapshots" / "s1" / "snapshot.json").unlink()
        with pytest.raises(NotFound):  # no manifest: an unfinished upload is never fetched
            await store.download_dir("snapshots/s1", tmp_path / "got2", "snapshot.json")
        assert not (tmp_path / "got2").exists()
        with pytest.raises(StorageError):
            await store.put_file("../escape", src / "state.mig")
        await store.delete_prefix("snapshots/s1")
        assert await store.list("snapshots/s1/") == []

    asyncio.run(go())


def test_store_urls_are_checked() -> None:
    for bad in ("ftp://x", "file://relative/path", "s3://", "s3://AKIA:secret@bucket/p",
                "s3://bucket/p?secret=x"):
        with pytest.raises(ConfigError):
            open_store(bad)


def test_s3_store_round_trip_on_a_real_s3_server(tmp_path: Path) -> None:
    pytest.importorskip("moto")
    port = _port()
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
    p = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    old = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    os.environ.update(AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s")
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), 0.5).close()
                break
            except OSError:
                time.sleep(0.2)
        src = tmp_path / "snap"
        src.mkdir()
        blob = os.urandom(9 << 20)  # over boto3's multipart threshold
        (src / "state.mig").write_bytes(blob)
        (src / "snapshot.json").write_text("{}")
        store = open_store(f"s3://hangar/pre?endpoint=http://127.0.0.1:{port}")

        async def go() -> None:
            await store.ensure()
            await store.upload_dir("snapshots/a", src, "snapshot.json")
            assert sorted(await store.list("snapshots/a/")) == ["snapshot.json", "state.mig"]
            await store.download_dir("snapshots/a", tmp_path / "got", "snapshot.json")
            assert (tmp_path / "got" / "state.mig").read_bytes() == blob
            await store.delete_prefix("snapshots/a")
            with pytest.raises(NotFound):
                await store.download_dir("snapshots/a", tmp_path / "got3", "snapshot.json")

        asyncio.run(go())
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        p.kill()
        p.wait()


def _obj(state: str, **status: object) -> dict:
    return {"metadata": {"name": "sb-000000000001", "labels": {}},
            "spec": {}, "status": {"nodeName": "n3", "epoch": 2, "state": state, **status}}


def test_records_from_etcd_are_untrusted_input() -> None:
    rec = SandboxObject.parse(_obj("sleeping"))
    assert rec.state is State.SLEEPING and rec.desired is State.RUNNING
    for bad in (_obj("zombie"), _obj("Running"), _obj(""), {"status": {}}, [1, 2], "x",
                _obj("running", epoch="two"), _obj("running", slot={}),
                _obj("running", nodeName=7), _obj("running", snapshot={"size": 1}),
                {**_obj("running"), "spec": {"desiredState": "later"}},
                {**_obj("running"), "spec": {"template": ["base"]}}):
        with pytest.raises(BadRecord):
            SandboxObject.parse(bad)


def test_record_moves_are_edges_of_the_lifecycle_table() -> None:
    rec = SandboxObject.parse(_obj("sleeping", view={"id": "sb-000000000001",
                                                      "state": "sleeping"}))
    rec.move(State.WAKING)
    assert rec.status["state"] == "waking" and rec.status["view"]["state"] == "waking"
    with pytest.raises(IllegalTransition):
        rec.move(State.DELETED)  # no such edge
    with pytest.raises(IllegalTransition):
        rec.move(State.FAILED)  # an edge only a failover makes, under its guard
    rec.move(State.FAILED, Guard.NODE_LOST)
    assert rec.follow(State.RUNNING) == [State.FAILED, State.RESTORING, State.RUNNING]
    rec.want(State.SLEEPING)
    assert rec.spec == {"desiredState": "sleeping", "operatingMode": "Suspended"}
    with pytest.raises(IllegalTransition):
        rec.want(State.DELETED)  # a running sandbox wants running or sleeping
    back = SandboxObject.parse(rec.to_json())
    assert back.state is State.RUNNING and back.desired is State.SLEEPING


@pytest.mark.parametrize("was,user,snapshot,to,guard", [
    ("running", None, True, "failed", Guard.NODE_LOST),
    ("unresponsive", None, False, "failed", Guard.NODE_LOST),
    ("snapshotting", None, True, "failed", Guard.NODE_LOST),
    ("waking", None, False, "failed", Guard.NODE_LOST),
    ("restoring", None, False, "failed", Guard.NODE_LOST),
    ("running", "u1", True, "sleeping", Guard.BACK_TO_SNAPSHOT),
    ("unresponsive", "u1", True, "sleeping", Guard.BACK_TO_SNAPSHOT),
    ("restoring", "u1", True, "sleeping", Guard.BACK_TO_SNAPSHOT),
    ("running", "u1", False, "failed", Guard.NODE_LOST),
    ("waking", None, True, "sleeping", None),
    ("snapshotting", "u1", True, "sleeping", Guard.BACK_TO_SNAPSHOT),
    ("stopping", "u1", True, "failed", None),
    ("sleeping", "u1", True, "sleeping", None),
    ("failed", None, False, "failed", None),
])
def test_failover_moves_each_record_by_one_edge(was: str, user: str | None, snapshot: bool,
                                                to: str, guard: Guard | None) -> None:
    raw = _obj(was, view={"id": "sb-000000000001", "state": was},
               **({"snapshot": {"id": "snap-00000000000a"}} if snapshot else {}))
    if user:
        raw["metadata"]["labels"] = {"hangar.dev/user": user}
    rec = SandboxObject.parse(raw)
    assert landing(rec) == (State(to), guard)
    if to != was:
        check({State(was)}, State(to), guard)  # an edge of the table, under that guard
    assert not hand_on(rec, "n2")  # another node's record: left alone
    assert hand_on(rec, "n3")
    assert rec.state is State(to) and rec.node is None and rec.epoch == 3
    assert rec.status["view"]["state"] == to
    assert ("n3" in rec.status["view"].get("error", "")) == (to != was)


def test_a_restart_mark_holds_the_failover_for_the_grace_only_and_goes_at_registering(
        etcd_url: str) -> None:
    """A node stopped gracefully leaves a restart mark: the reconciler waits the grace, not
    ``failover_after_s``, then hands its sandboxes on; registering again deletes the mark."""
    async def go() -> None:
        e = _client(etcd_url)
        d = Directory(e)
        sid = "sb-0000000000ee"
        raw = _obj("running", view={"id": sid, "state": "running"})
        raw["metadata"]["name"], raw["status"]["nodeName"] = sid, "nr"
        await e.put(sandbox_key(sid), raw)
        info = NodeInfo(name="nr", address="127.0.0.1:1", capacity=1, free=0, engine="qemu",
                        accel="tcg", cpu_model="", images=[])

        async def nothing(*_: object) -> None:
            return None

        m = Membership(e, d, "nr", 2, lambda: info, nothing, nothing)
        try:
            await m.register()
            await m.mark_restart(30)
            await e.revoke(m.lease)  # the stopped node's lease ends (at once, here)
            await d.load()
            assert not d.alive("nr") and d.restarting == {"nr"}
            f = Failover(d, m, after_s=0, grace_s=1.5)
            await f.tick()
            assert (await d.fresh(sid)).state is State.RUNNING  # held: no wait of 0 s
            await asyncio.sleep(1.6)
            await f.tick()  # the reconciler's own grace, whatever the mark's lease says
            moved = await d.fresh(sid)
            assert moved.state is State.FAILED and moved.node is None
            await m.register()  # back: the mark goes, so a crash now is handed on at once
            await d.load()
            assert d.alive("nr") and d.restarting == set()
        finally:
            await e.delete("/hangar/", prefix=True)
            await e.close()

    asyncio.run(go())


def test_an_unreadable_record_is_a_clear_409_and_the_others_still_load(etcd_url: str) -> None:
    async def go() -> None:
        e = _client(etcd_url)
        d = Directory(e)
        good = SandboxObject.parse(_obj("sleeping"))
        good.name = "sb-0000000000aa"
        await e.put(sandbox_key("sb-0000000000aa"), good.to_json())
        await e.put(sandbox_key("sb-0000000000bb"), _obj("zombie"))
        await e.put(sandbox_key("sb-0000000000cc"), "not json at all {")
        await d.load()
        assert set(d.sandboxes) >= {"sb-0000000000aa"}
        assert not {"sb-0000000000bb", "sb-0000000000cc"} & set(d.sandboxes)
        for sid in ("sb-0000000000bb", "sb-0000000000cc"):
            for read in (d.lookup, d.fresh):
                with pytest.raises(Conflict) as info:
                    await read(sid)
                assert info.value.status == 409 and sandbox_key(sid) in info.value.message
        fresh = await d.fresh("sb-0000000000aa")
        assert fresh is not None and fresh.state is State.SLEEPING
        await e.delete("/hangar/sandboxes/", prefix=True)
        await e.close()

    asyncio.run(go())


def test_no_cluster_module_imports_the_api() -> None:
    root = Path(list(hangar.cluster.__path__)[0])
    for f in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert not name.startswith("hangar.api"), f"{f.name} imports {name}"
    mods = ",".join(f"hangar.cluster.{f.stem}" for f in root.glob("*.py") if f.stem != "__init__")
    out = subprocess.run([sys.executable, "-c", f"import importlib, sys\n"
                          f"for m in {mods!r}.split(','): importlib.import_module(m)\n"
                          "print(sorted(m for m in sys.modules if m.startswith('hangar.api')))"],
                         capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(root.parents[1])})
    assert out.stdout.strip() == "[]", out.stdout


def test_etcd_answers_only_a_client_with_a_certificate_of_the_cluster(
        etcd_url: str, tmp_path: Path) -> None:
    make(tmp_path / "stranger", [("t", "127.0.0.1")])  # another CA, same names

    async def go() -> None:
        e = _client(etcd_url)
        await e.put("/hangar/probe", "x")
        assert (await e.get("/hangar/probe")).value == b"x"
        await e.close()
        no_cert = ssl.create_default_context(cafile=str(PKI["t"] / "ca.crt"))
        other = tls_from(tmp_path / "stranger" / "t").context()
        other.load_verify_locations(str(PKI["t"] / "ca.crt"))  # trusts etcd, not trusted
        for ctx in (no_cert, other):
            c = Etcd([etcd_url], timeout=1.0, tls=ctx)
            with pytest.raises(EtcdUnavailable):
                await c.get("/hangar/probe")
            await c.close()
        plain = Etcd([etcd_url.replace("https://", "http://")], timeout=1.0)
        with pytest.raises(EtcdUnavailable):
            await plain.get("/hangar/probe")
        await plain.close()
        with pytest.raises(ValueError):
            Etcd([etcd_url])  # https without the client's files

    asyncio.run(go())
    for f in (PKI["t"] / "node.key", PKI["t"] / "etcd.key", PKI["t"].parent / "ca.key"):
        assert f.stat().st_mode & 0o777 == 0o600, f


def test_forged_records_are_refused_with_a_log_line_and_the_watch_goes_on(
        etcd_url: str, caplog: pytest.LogCaptureFixture) -> None:
    good = SandboxObject.parse(_obj("sleeping"))
    good.name = "sb-0000000000ee"
    forged_snapshot = _obj("sleeping", snapshot={"id": "../../../../etc", "sizeBytes": 1})
    forged_snapshot["metadata"]["name"] = "sb-0000000000dd"
    node = {"name": "evil", "address": "169.254.169.254:80", "capacity": 9, "free": 9,
            "engine": "qemu", "accel": "tcg", "cpu_model": "", "images": []}
    forged: list[tuple[bytes | str, object]] = [
        ("/hangar/sandboxes/../../etc/passwd", good.to_json()),       # traversal in the key
        ("/hangar/sandboxes/sb-0000000000dd", forged_snapshot),        # traversal in a field
        ("/hangar/sandboxes/sb-0000000000ff", good.to_json()),         # names another id
        ("/hangar/nodes/evil", node),                                  # metadata address
        ("/hangar/nodes/n9", {**node, "name": "n9", "address": "10.0.0.9:80/x"}),
        ("/hangar/machines/u1", {"sandboxId": "../sb-0000000000ee"}),
        ("/hangar/snapshots/snap-00000000000b", {"id": "snap-00000000000b", "image": "../x"}),
        ("/hangar/slots/x9/../0", "sb-0000000000ee"),
        ("/hangar/leader", "../n1"),
        ("/hangar/sandboxes/sb-0000000000cc", "[" * 200_000),          # nested past recursion
        (b"/hangar/sandboxes/\xff\xfe", good.to_json()),               # not UTF-8
    ]

    async def go() -> None:
        e = _client(etcd_url)
        d = Directory(e)
        await d.load()
        d.start()
        try:
            caplog.set_level("WARNING", logger="hangar.cluster.directory")
            for key, value in forged:
                await e.put(key, value)  # type: ignore[arg-type]
            await e.put(sandbox_key(good.name), good.to_json())  # after them: still seen
            deadline = time.monotonic() + 10
            while good.name not in d.sandboxes and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert set(d.sandboxes) == {good.name}, d.sandboxes
            assert d.nodes == {} and d.machines == {} and d.snapshots == {}
            assert d.leader is None and not d.slots.get("x9")
            refused = [r for r in caplog.records if "ignored" in r.getMessage()]
            assert len(refused) == len(forged), [r.__dict__.get("record") for r in refused]
            await d.load()  # a reload reads them all again: the same, no error
            assert set(d.sandboxes) == {good.name}
            with pytest.raises(Conflict):
                await d.fresh("sb-0000000000dd")
            assert await d.lookup("../../etc/passwd") is None  # never read from etcd
        finally:
            await d.close()
            await e.delete("/hangar/", prefix=True)
            await e.close()

    asyncio.run(go())


def test_the_node_token_is_read_from_raw_headers_and_a_bad_one_is_401() -> None:
    token = "t" * 43
    assert node_token([(b"x-api-key", b"k")], token) is False
    assert node_token([(b"X-Hangar-Node-Token", token.encode())], token) is True
    for bad in ([(b"x-hangar-node-token", b"\xff\xfe\x00")],
                [(b"x-hangar-node-token", "é".encode())],
                [(b"x-hangar-node-token", b"t" * 129)],
                [(b"x-hangar-node-token", b"")],
                [(b"x-hangar-node-token", token.encode())] * 2,
                [(b"x-hangar-node-token", b"t" * 42 + b"u")]):
        with pytest.raises(Unauthorized) as info:
            node_token(bad, token)
        assert info.value.status == 401
    with pytest.raises(Unauthorized):
        node_token([(b"x-hangar-node-token", token.encode())], "")  # no cluster config yet


def test_nodes_and_commands_refuse_etcd_without_tls(tmp_path: Path) -> None:
    from hangar.cluster.node import ClusterNode
    from hangar.config import Settings
    from hangar.layout import Layout

    s = Settings(data_dir=tmp_path, etcd="http://10.0.0.1:2379", node_name="n1",
                 advertise="10.0.0.1:8080")
    with pytest.raises(ConfigError) as info:
        ClusterNode(s, Layout(tmp_path))
    assert "https://" in info.value.message
    s = Settings(data_dir=tmp_path, etcd="https://10.0.0.1:2379", node_name="n1",
                 advertise="10.0.0.1:8080")
    with pytest.raises(ConfigError) as info:  # no certificate folder
        ClusterNode(s, Layout(tmp_path))
    assert "etcd-pki" in info.value.message
    for bad in ({"node_name": "../n1"}, {"advertise": "169.254.169.254:80"}):
        with pytest.raises(ConfigError):
            ClusterNode(s.model_copy(update=bad), Layout(tmp_path))
    r = subprocess.run([sys.executable, "-m", "hangar.cli", "cluster", "init", "--store",
                        f"file://{tmp_path}/store", "--etcd", "http://127.0.0.1:1",
                        "--key-file", str(tmp_path / "key")],
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(Path(hangar.__file__).parents[1])})
    assert r.returncode == 2 and "TLS" in r.stderr, r.stderr


def test_the_control_endpoints_come_from_etcd_urls_and_node_addresses() -> None:
    from hangar.cluster.guard import endpoints

    got = endpoints(["https://10.0.0.1:2379", "https://10.0.0.2:2380", "https://[fd00::1]:2379",
                     "https://localhost:2379", "not a url"],
                    ["10.0.0.3:8080", "10.0.0.4", "[fd00::2]:8080"])
    assert got == {("10.0.0.1", 2379), ("10.0.0.2", 2380), ("127.0.0.1", 2379),
                   ("10.0.0.3", 8080), ("10.0.0.4", 8080)}


def test_the_gateway_relays_websocket_messages_of_the_nodes_own_size() -> None:
    """The gateway's relay from an owner node takes messages up to the nodes' own limit and
    holds one frame before it stops reading (review 29j J-H5: no limit and 16 frames held
    about 270 MiB a connection, counted by no budget)."""
    from hangar.api.proxy.websocket import WS_MAX_MESSAGE
    from hangar.cluster import wsproxy

    assert wsproxy.WS_MAX_MESSAGE == WS_MAX_MESSAGE and wsproxy.RELAY_QUEUE == 1


def test_team_key_and_labelled_records_from_etcd_are_untrusted_input() -> None:
    team = TR.team_record("acme", {"created": 1.0, "max_sandboxes": 2, "max_vcpus": None})
    assert team.max_sandboxes == 2 and team.max_vcpus is None
    assert TR.team_record("acme", TR.team_json(team)) == team
    for name, bad in (("Acme", {}), ("../x", {}), ("acme", {"max_sandboxes": -1}),
                      ("acme", {"max_vcpus": "8"}), ("acme", {"max_memory_mib": 1 << 41}),
                      ("acme", [1]), ("acme", {"created": "now"})):
        with pytest.raises(BadRecord):
            TR.team_record(name, bad)
    key = TR.key_record("ci", {"sha256": "ab" * 32, "team": "acme", "created": 2.0})
    assert key.team == "acme"
    for name, bad in (("default!", {"sha256": "ab" * 32, "team": "acme"}),
                      ("ci", {"sha256": "AB" * 32, "team": "acme"}),
                      ("ci", {"sha256": "ab" * 31, "team": "acme"}),
                      ("ci", {"sha256": "ab" * 32}), ("ci", {"sha256": "ab" * 32, "team": "A/"})):
        with pytest.raises(BadRecord):
            TR.key_record(name, bad)
    obj = _obj("running")
    obj["metadata"]["labels"] = {"hangar.dev/team": "acme", "hangar.dev/user": "acme/alice"}
    rec = SandboxObject.parse(obj)
    assert (rec.team, rec.user) == ("acme", "acme/alice")
    for labels in ({"hangar.dev/team": "../acme"}, {"hangar.dev/user": "a/b/c"},
                   {"hangar.dev/user": "../alice"}):
        obj["metadata"]["labels"] = labels
        with pytest.raises(BadRecord):
            SandboxObject.parse(obj)
    assert TR.quota_count(b"41") == 41 and TR.quota_count(b"\xff") == 0


def test_teams_and_keys_reach_every_node_and_a_quota_holds_under_racing_claims(
        etcd_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """Teams and keys written in etcd are cached by the directory (bad ones left out and
    logged) and accepted by a key ring; twelve claims of a team allowed two sandboxes,
    racing, give exactly two, the others the one host's 429 naming max_sandboxes."""
    from hangar.cluster import teams as T
    from hangar.core.service import Usage
    from hangar.errors import QuotaExceeded
    from hangar.keys import KeyRing

    async def go() -> None:
        e = _client(etcd_url)
        d = Directory(e)
        ring = KeyRing(Path("/nonexistent/api-key"), Path("/nonexistent/api-keys"))
        d.on_keys(lambda ks: ring.share_team_keys([(n, k.sha256, k.team)
                                                   for n, k in ks.items()]))
        await d.load()
        d.start()
        try:
            caplog.set_level("WARNING", logger="hangar.cluster.directory")
            await T.create_team(e, "acme", {"max_sandboxes": 2})
            with pytest.raises(Conflict):
                await T.create_team(e, "acme", {})
            key = await T.add_key(e, "ci", "acme")
            with pytest.raises(NotFound):
                await T.add_key(e, "x", "nobody")
            await e.put("/hangar/teams/Bad..", {"max_sandboxes": 1})
            await e.put("/hangar/keys/forged", {"sha256": "zz", "team": "acme"})
            def ignored() -> set[object]:
                return {r.__dict__.get("record") for r in caplog.records
                        if "ignored" in r.getMessage()}

            # the watch delivers the puts in order, but the key ring can match "ci" before
            # the two bad records after it are read: wait for those as well
            deadline = time.monotonic() + 10
            while (ring.match(key) is None or len(ignored()) < 2) \
                    and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert set(d.teams) == {"acme"} and set(d.keys) == {"ci"}
            assert ring.team_of(ring.match(key) or "") == "acme"
            assert ignored() == {"/hangar/teams/Bad..", "/hangar/keys/forged"}, ignored()
            nodes = [NodeInfo(name="x1", address="10.0.0.1:8080", capacity=20, free=20,
                              engine="qemu", accel="tcg", cpu_model="", images=[])]

            async def one(i: int) -> str:
                sid = f"sb-{i + 0x100:012x}"

                def record(n: NodeInfo, k: int) -> SandboxObject:
                    return SandboxObject(name=sid, labels={"hangar.dev/team": "acme"},
                                         spec={"template": {"image": "base", "vcpus": 1, "memoryMiB": 256,
                                                            "diskMiB": 512}},
                                         status={"nodeName": n.name, "slot": k, "epoch": 1,
                                                 "state": State.CREATING.value})
                try:
                    await T.within_quota(e, "acme", Usage(1, 1, 256, 512), lambda c, o: d.claim(
                        sid, nodes, record, c, lambda n: o))
                    return "201"
                except QuotaExceeded as exc:
                    assert exc.context["quota"] == "max_sandboxes" and exc.status == 429
                    return f"429 {exc.context['limit']} {exc.context['used']}"

            won = await asyncio.gather(*(one(i) for i in range(12)))
            assert sorted(won) == ["201"] * 2 + ["429 2 2"] * 10, won
            with pytest.raises(Conflict):  # a key and two sandboxes are left
                await T.remove_team(e, "acme", {})
        finally:
            await d.close()
            await e.delete("/hangar/", prefix=True)
            await e.close()

    asyncio.run(go())
