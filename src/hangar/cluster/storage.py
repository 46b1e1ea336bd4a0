"""Shared snapshot storage: an S3 bucket or a shared folder (NFS), by URL.

``open_store(url)``:

``s3://BUCKET/PREFIX?endpoint=http://host:9000&region=us-east-1``
    any S3-compatible server (AWS, MinIO, SeaweedFS, Ceph RGW...) through
    boto3; credentials come from the standard AWS variables or files of
    each node (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``), never
    from the URL, which etcd stores and every node reads.
``file:///PATH``
    a folder every node mounts at the same path (NFS, CephFS...).

A stored set of files lives under one prefix (a snapshot:
``snapshots/<id>/``; an image build: ``images/<name>-<digest>/``). Its
manifest is written last and read first: a prefix without one is an
unfinished upload, never restored. Downloads write the manifest last too,
so the local folder is complete or not a snapshot at all
(``hangar.engines.snapshot_io.read_manifest`` refuses it).
"""

from __future__ import annotations

import abc
import asyncio
import os
import shutil
from pathlib import Path
from urllib.parse import parse_qs, urlparse

from hangar.errors import ConfigError, HangarError, NotFound


class StorageError(HangarError):
    """The shared storage refused or failed a transfer (502: retry later)."""

    status, code, retryable = 502, "storage_error", True


def _files(src: Path) -> list[str]:
    out = []
    for p in sorted(src.rglob("*")):
        if p.is_file() and not p.is_symlink():
            out.append(str(p.relative_to(src)))
    return out


class SharedStore(abc.ABC):
    """Files under prefixes, with a manifest written last."""

    url: str

    async def upload_dir(self, prefix: str, src: Path, manifest: str) -> int:
        """Upload every file under ``src`` to ``prefix``, ``manifest`` last; returns bytes sent.

        Raises StorageError (and leaves no manifest) on failure.
        """
        names = _files(src)
        if manifest not in names:
            raise StorageError(f"{src} has no {manifest}")
        total = 0
        for name in [n for n in names if n != manifest] + [manifest]:
            total += await self.put_file(f"{prefix.rstrip('/')}/{name}", src / name)
        return total

    async def download_dir(self, prefix: str, dest: Path, manifest: str) -> int:
        """Fetch the files under ``prefix`` into ``dest``, ``manifest`` last; returns bytes.

        Raises NotFound when the prefix has no manifest (unfinished or gone),
        StorageError on a failed transfer (``dest`` is then removed).
        """
        prefix = prefix.rstrip("/") + "/"
        names = await self.list(prefix)
        if manifest not in names:
            raise NotFound(f"no finished upload at {prefix} in {self.url}", prefix=prefix)
        part = dest.with_name(dest.name + ".part")
        shutil.rmtree(part, ignore_errors=True)
        part.mkdir(parents=True)
        total = 0
        try:
            for name in [n for n in names if n != manifest] + [manifest]:
                (part / name).parent.mkdir(parents=True, exist_ok=True)
                total += await self.get_file(prefix + name, part / name)
            shutil.rmtree(dest, ignore_errors=True)
            os.replace(part, dest)
        except BaseException:
            shutil.rmtree(part, ignore_errors=True)
            raise
        return total

    @abc.abstractmethod
    async def put_file(self, key: str, src: Path) -> int: ...

    @abc.abstractmethod
    async def get_file(self, key: str, dest: Path) -> int: ...

    @abc.abstractmethod
    async def list(self, prefix: str) -> list[str]:
        """Names (relative to ``prefix``) of the files under it."""

    @abc.abstractmethod
    async def delete_prefix(self, prefix: str) -> None: ...

    async def ensure(self) -> None:
        """Make the bucket or folder if it is missing (``hangar cluster init``)."""


class FileStore(SharedStore):
    """A folder, usually an NFS mount shared by every node."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = f"file://{root}"

    def _path(self, key: str) -> Path:
        p = (self.root / key.lstrip("/")).resolve()
        if not str(p).startswith(str(self.root.resolve()) + os.sep):
            raise StorageError(f"key {key!r} leaves the store")
        return p

    async def put_file(self, key: str, src: Path) -> int:
        dst = self._path(key)

        def copy() -> int:
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = dst.with_name(dst.name + ".tmp")
            shutil.copyfile(src, tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, dst)
            return dst.stat().st_size

        try:
            return await asyncio.to_thread(copy)
        except OSError as exc:
            raise StorageError(f"writing {key} to {self.url} failed: {exc}") from None

    async def get_file(self, key: str, dest: Path) -> int:
        src = self._path(key)
        try:
            await asyncio.to_thread(shutil.copyfile, src, dest)
        except OSError as exc:
            raise StorageError(f"reading {key} from {self.url} failed: {exc}") from None
        return dest.stat().st_size

    async def list(self, prefix: str) -> list[str]:
        base = self._path(prefix.rstrip("/") or ".") if prefix.strip("/") else self.root
        if not base.is_dir():
            return []
        return [n for n in _files(base) if not n.endswith(".tmp")]

    async def delete_prefix(self, prefix: str) -> None:
        if not prefix.strip("/"):
            raise StorageError("refusing to delete the whole store")
        await asyncio.to_thread(shutil.rmtree, self._path(prefix.rstrip("/")), True)

    async def ensure(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)


class S3Store(SharedStore):
    """An S3 bucket (any S3-compatible server) through boto3, in worker threads."""

    def __init__(self, bucket: str, prefix: str, endpoint: str | None, region: str | None,
                 url: str) -> None:
        import boto3
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = url
        self.client = boto3.client(
            "s3", endpoint_url=endpoint, region_name=region or "us-east-1",
            config=Config(retries={"max_attempts": 3, "mode": "standard"},
                          connect_timeout=3, read_timeout=60))

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key.lstrip('/')}" if self.prefix else key.lstrip("/")

    async def _run(self, what: str, fn, *args, **kwargs):  # type: ignore[no-untyped-def]
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except (BotoCoreError, ClientError) as exc:
            raise StorageError(f"{what} in {self.url} failed: {exc}") from None

    async def put_file(self, key: str, src: Path) -> int:
        await self._run(f"uploading {key}", self.client.upload_file, str(src), self.bucket,
                        self._key(key))
        return src.stat().st_size

    async def get_file(self, key: str, dest: Path) -> int:
        await self._run(f"downloading {key}", self.client.download_file, self.bucket,
                        self._key(key), str(dest))
        return dest.stat().st_size

    async def list(self, prefix: str) -> list[str]:
        full = self._key(prefix)

        def listing() -> list[str]:
            out: list[str] = []
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=full)
            for page in pages:
                out += [o["Key"][len(full):] for o in page.get("Contents") or []]
            return out

        return await self._run(f"listing {prefix}", listing)

    async def delete_prefix(self, prefix: str) -> None:
        if not prefix.strip("/"):
            raise StorageError("refusing to delete the whole store")
        names = await self.list(prefix)
        full = self._key(prefix)
        for i in range(0, len(names), 1000):
            chunk = [{"Key": full + n} for n in names[i:i + 1000]]
            await self._run(f"deleting {prefix}", self.client.delete_objects,
                            Bucket=self.bucket, Delete={"Objects": chunk})

    async def ensure(self) -> None:
        from botocore.exceptions import ClientError

        try:
            await asyncio.to_thread(self.client.head_bucket, Bucket=self.bucket)
        except ClientError:
            await self._run("creating the bucket", self.client.create_bucket, Bucket=self.bucket)


def open_store(url: str) -> SharedStore:
    """The store a URL names (see the module docstring). Raises ConfigError for a bad URL."""
    u = urlparse(url)
    if u.scheme == "file":
        if not u.path.startswith("/") or u.netloc:
            raise ConfigError(f"a file store needs an absolute path: file:///path, not {url!r}")
        return FileStore(Path(u.path))
    if u.scheme == "s3":
        if not u.netloc:
            raise ConfigError(f"an S3 store needs a bucket: s3://bucket/prefix, not {url!r}")
        q = parse_qs(u.query)
        if u.username or u.password or any(k.lower() in ("secret", "key", "password")
                                           for k in q):
            raise ConfigError("no credentials in the store URL: give them to each node "
                              "as AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
        return S3Store(u.netloc, u.path, (q.get("endpoint") or [None])[0],
                       (q.get("region") or [None])[0], url)
    raise ConfigError(f"unknown store {url!r}: use s3://bucket/prefix?endpoint=... or "
                      "file:///path")
