"""The cluster's parts without VMs: the etcd client and claims on a real etcd, shared storage
on a real folder and a real S3 server (moto's server mode), all on loopback."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hangar.cluster.directory import Directory
from hangar.cluster.etcd import Etcd, EtcdUnavailable, cmp_version, op_put
from hangar.cluster.records import NodeInfo, SandboxObject
from hangar.cluster.storage import FileStore, StorageError, open_store
from hangar.errors import ConfigError, LimitExceeded, NotFound


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def etcd_url() -> Iterator[str]:
    if shutil.which("etcd") is None:
        pytest.skip("needs etcd (apt-get install etcd-server)")
    d = Path(tempfile.mkdtemp(prefix="hg-etcd-"))
    client, peer = _port(), _port()
    p = subprocess.Popen(["etcd", "--name", "t", "--data-dir", str(d / "data"),
                          "--listen-client-urls", f"http://127.0.0.1:{client}",
                          "--advertise-client-urls", f"http://127.0.0.1:{client}",
                          "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                          "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                          "--initial-cluster", f"t=http://127.0.0.1:{peer}"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{client}"
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
    e = Etcd([url])
    try:
        await e.status()
    finally:
        await e.close()


def test_claims_never_overshoot_and_a_dead_endpoint_is_skipped(etcd_url: str) -> None:
    dead = f"http://127.0.0.1:{_port()}"

    async def go() -> None:
        e = Etcd([dead, etcd_url])  # the first member is down: every call fails over
        d = Directory(e)
        nodes = [NodeInfo(name=f"x{i}", address="", capacity=c, free=c, engine="qemu",
                          accel="tcg", cpu_model="", images=[]) for i, c in ((1, 1), (2, 2))]

        def record(node: NodeInfo, k: int, sid: str) -> SandboxObject:
            return SandboxObject(name=sid, spec={}, status={"nodeName": node.name, "slot": k,
                                                            "epoch": 1, "state": "creating"})

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
        gone = Etcd([dead], timeout=0.5)
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
