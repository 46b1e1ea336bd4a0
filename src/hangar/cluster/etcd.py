"""A thin typed asyncio client of etcd's v3 API over its JSON gateway (HTTP), with httpx.

etcd 3.4 (Debian's ``etcd-server``) serves every gRPC method of its v3
API also as JSON at ``POST /v3/<service>/<method>``: keys and values are
base64, 64-bit integers are strings. This module speaks exactly the calls
Hangar needs::

    range, put, delete     POST /v3/kv/range, /v3/kv/put, /v3/kv/deleterange
    txn                    POST /v3/kv/txn        (compare-and-set: every claim)
    lease grant/keepalive  POST /v3/lease/grant, /v3/lease/keepalive, /v3/lease/revoke
    watch                  POST /v3/watch         (one chunked JSON object per event batch)
    status                 POST /v3/maintenance/status
    member list            POST /v3/cluster/member/list

Why not a library: ``aetcd`` (asyncio, gRPC) and ``etcd3gw`` (OpenStack,
blocking ``requests``) are maintained, but both talk to one endpoint; a
node whose local member is down would lose etcd although the cluster has
quorum. This client takes every member's URL and fails over (the last
member that answered is tried first), puts a deadline on every call, and
maps every failure to ``EtcdUnavailable`` (503, retryable), so the API
answers quorum loss with a clear retryable error instead of hanging.

A call that reaches a member that has lost its leader fails (etcd answers
``etcdserver: no leader`` or times out the proposal); linearizable reads
fail the same way, so no answer here is ever stale.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import ssl
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from hangar.errors import Unavailable

log = logging.getLogger("hangar.cluster.etcd")

CALL_TIMEOUT_S = 2.0
"""Deadline of one call to one member, seconds (a proposal without quorum never returns)."""


class EtcdUnavailable(Unavailable):
    """No etcd member could complete the call: quorum lost, or no member reachable (503)."""

    code = "cluster_unavailable"


def _b64(b: bytes | str) -> str:
    return base64.b64encode(b.encode() if isinstance(b, str) else b).decode()


def _unb64(s: str | None) -> bytes:
    return base64.b64decode(s) if s else b""


def prefix_end(prefix: str) -> str:
    """The ``range_end`` that makes a range or watch cover every key starting with ``prefix``."""
    b = bytearray(prefix.encode())
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1]).decode("latin-1")
    return "\0"


@dataclass(frozen=True)
class KV:
    """One key: its value and revisions (``version`` 0 means absent)."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int = 0

    def json(self) -> Any:
        return json.loads(self.value)

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> "KV":
        # A key is any bytes in etcd: one that is not UTF-8 is kept (replaced characters)
        # for the directory to refuse by its pattern, never an error that stops a watch.
        return cls(key=_unb64(raw.get("key")).decode("utf-8", "replace"),
                   value=_unb64(raw.get("value")),
                   create_revision=int(raw.get("create_revision", 0)),
                   mod_revision=int(raw.get("mod_revision", 0)),
                   version=int(raw.get("version", 0)), lease=int(raw.get("lease", 0)))


@dataclass(frozen=True)
class Event:
    """One watch event: ``PUT`` (``kv`` is the new value) or ``DELETE``."""

    type: str
    kv: KV


# -- transaction parts ----------------------------------------------------------------


def cmp_version(key: str, version: int) -> dict[str, Any]:
    """Compare: the key's version equals ``version`` (0: the key does not exist)."""
    return {"key": _b64(key), "target": "VERSION", "result": "EQUAL", "version": str(version)}


def cmp_mod(key: str, mod_revision: int) -> dict[str, Any]:
    """Compare: the key was last written at ``mod_revision`` (nobody wrote it since)."""
    return {"key": _b64(key), "target": "MOD", "result": "EQUAL",
            "mod_revision": str(mod_revision)}


def cmp_value(key: str, value: bytes | str) -> dict[str, Any]:
    return {"key": _b64(key), "target": "VALUE", "result": "EQUAL", "value": _b64(value)}


def op_put(key: str, value: bytes | str | Any, lease: int = 0) -> dict[str, Any]:
    """A put in a transaction; a value that is not bytes or str is stored as JSON."""
    if not isinstance(value, (bytes, str)):
        value = json.dumps(value, separators=(",", ":"))
    req: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        req["lease"] = str(lease)
    return {"request_put": req}


def op_delete(key: str, prefix: bool = False) -> dict[str, Any]:
    req = {"key": _b64(key)}
    if prefix:
        req["range_end"] = _b64(prefix_end(key))
    return {"request_delete_range": req}


def op_get(key: str) -> dict[str, Any]:
    return {"request_range": {"key": _b64(key)}}


class Etcd:
    """An etcd v3 client over the JSON gateway of any of ``endpoints``.

    ``endpoints`` are ``https://host:port`` (a cluster's etcd: ``tls`` is the client
    context, ``hangar.cluster.pki.Tls.context``, that checks the member's certificate
    and presents this node's) or ``http://host:port`` (only a bare etcd of a test).
    Raises ValueError for no endpoint, or an https one without ``tls``.
    """

    def __init__(self, endpoints: Sequence[str], timeout: float = CALL_TIMEOUT_S,
                 tls: ssl.SSLContext | None = None) -> None:
        eps = [e.strip().rstrip("/") for e in endpoints if e.strip()]
        if not eps:
            raise ValueError("no etcd endpoint given")
        if tls is None and any(e.startswith("https://") for e in eps):
            raise ValueError("https etcd endpoints need the client's TLS files")
        self.endpoints = eps
        self.timeout = timeout
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=min(1.0, timeout)),
                                       verify=tls if tls is not None else True)
        self._first = 0

    async def close(self) -> None:
        await self._http.aclose()

    @classmethod
    def parse_urls(cls, urls: str) -> list[str]:
        """Endpoints from a comma-separated list (``https://a:2379,https://b:2379``)."""
        return [u.strip() for u in urls.split(",") if u.strip()]

    async def call(self, path: str, body: dict[str, Any],
                   timeout: float | None = None) -> dict[str, Any]:
        """POST ``body`` to ``/v3/<path>`` on the first member that answers.

        Raises ``EtcdUnavailable`` when none does within its deadline, or all
        answer with an error of etcd's own (no leader, timeouts).
        """
        errors = []
        n = len(self.endpoints)
        for i in range(n):
            idx = (self._first + i) % n
            url = f"{self.endpoints[idx]}/v3/{path}"
            try:
                r = await self._http.post(url, json=body, timeout=timeout or self.timeout)
            except (httpx.HTTPError, OSError) as exc:  # ssl.SSLError: a refused certificate
                errors.append(f"{self.endpoints[idx]}: {type(exc).__name__}")
                continue
            try:
                data = r.json()
            except ValueError:
                errors.append(f"{self.endpoints[idx]}: HTTP {r.status_code}")
                continue
            if r.status_code != 200 or "error" in data:
                msg = data.get("message") or data.get("error") or f"HTTP {r.status_code}"
                if "lease not found" in str(msg):
                    raise LeaseGone(str(msg))
                errors.append(f"{self.endpoints[idx]}: {msg}")
                continue
            self._first = idx
            return data
        raise EtcdUnavailable("the cluster store (etcd) cannot be reached or has no quorum; "
                              "retry shortly", detail="; ".join(errors)[:500])

    # -- kv ----------------------------------------------------------------------------

    async def get(self, key: str) -> KV | None:
        data = await self.call("kv/range", {"key": _b64(key)})
        kvs = data.get("kvs") or []
        return KV.parse(kvs[0]) if kvs else None

    async def get_prefix(self, prefix: str) -> tuple[list[KV], int]:
        """Every key under ``prefix`` and the store's revision at the read."""
        data = await self.call("kv/range", {"key": _b64(prefix),
                                            "range_end": _b64(prefix_end(prefix))})
        rev = int(data.get("header", {}).get("revision", 0))
        return [KV.parse(kv) for kv in data.get("kvs") or []], rev

    async def put(self, key: str, value: bytes | str | Any, lease: int = 0) -> int:
        """Write a key (JSON for anything but bytes or str); returns the new revision."""
        data = await self.call("kv/put", op_put(key, value, lease)["request_put"])
        return int(data.get("header", {}).get("revision", 0))

    async def delete(self, key: str, prefix: bool = False) -> int:
        """Delete a key (or every key under it); returns how many were deleted."""
        data = await self.call("kv/deleterange", op_delete(key, prefix)["request_delete_range"])
        return int(data.get("deleted", 0))

    async def txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]],
                  failure: list[dict[str, Any]] | None = None) -> tuple[bool, list[dict[str, Any]]]:
        """One transaction: if every ``compare`` holds, run ``success``, else ``failure``.

        Returns (succeeded, responses); a range in the responses has its
        ``kvs`` parsed to ``KV``.
        """
        data = await self.call("kv/txn", {"compare": compare, "success": success,
                                          "failure": failure or []})
        out = []
        for resp in data.get("responses") or []:
            rr = resp.get("response_range")
            if rr is not None:
                out.append({"kvs": [KV.parse(kv) for kv in rr.get("kvs") or []]})
            else:
                out.append(resp)
        return bool(data.get("succeeded")), out

    # -- leases ------------------------------------------------------------------------

    async def grant(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds; returns its id."""
        data = await self.call("lease/grant", {"TTL": str(ttl)})
        return int(data["ID"])

    async def keepalive(self, lease: int, timeout: float | None = None) -> int:
        """Renew a lease once (``timeout``: per member, seconds); returns its TTL, seconds.
        Raises ``LeaseGone`` when it expired."""
        data = await self.call("lease/keepalive", {"ID": str(lease)}, timeout=timeout)
        ttl = int((data.get("result") or {}).get("TTL", 0))
        if ttl <= 0:
            raise LeaseGone(f"lease {lease:x} expired")
        return ttl

    async def revoke(self, lease: int) -> None:
        try:
            await self.call("lease/revoke", {"ID": str(lease)})
        except LeaseGone:
            pass

    async def member_urls(self) -> list[str]:
        """Every member's client and peer URLs (``cluster/member/list``)."""
        data = await self.call("cluster/member/list", {})
        urls: list[str] = []
        for m in data.get("members") or []:
            if isinstance(m, dict):
                for k in ("peerURLs", "clientURLs"):
                    urls += [u for u in m.get(k) or [] if isinstance(u, str)]
        return urls

    async def status(self) -> dict[str, Any]:
        """The answering member's status (``leader`` is "0" when it has none)."""
        return await self.call("maintenance/status", {})

    # -- watch -------------------------------------------------------------------------

    async def watch_prefix(self, prefix: str, start_revision: int) -> AsyncIterator[list[Event]]:
        """Batches of events under ``prefix`` from ``start_revision`` on, until cancelled.

        Reconnects (to any member) when the stream breaks, from the revision
        after the last one seen. Raises ``Compacted`` when etcd no longer has
        the revisions asked for (the caller reloads and watches again).
        """
        rev = start_revision
        n = len(self.endpoints)
        attempt = 0
        while True:
            url = f"{self.endpoints[(self._first + attempt) % n]}/v3/watch"
            body = {"create_request": {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)),
                                       "start_revision": str(rev), "progress_notify": True}}
            try:
                async with self._http.stream("POST", url, json=body,
                                             timeout=httpx.Timeout(None, connect=1.0)) as r:
                    async for line in r.aiter_lines():
                        if not line.strip():
                            continue
                        msg = json.loads(line)
                        if "error" in msg:
                            raise httpx.HTTPError(str(msg["error"]))
                        res = msg.get("result") or {}
                        if int(res.get("compact_revision", 0) or 0):
                            raise Compacted(int(res["compact_revision"]))
                        if res.get("canceled"):
                            raise httpx.HTTPError(res.get("cancel_reason") or "watch canceled")
                        attempt = 0
                        evs = [Event(e.get("type", "PUT"), KV.parse(e["kv"]))
                               for e in res.get("events") or []]
                        if evs:
                            rev = max(e.kv.mod_revision for e in evs) + 1
                            yield evs
            except (httpx.HTTPError, ValueError, OSError) as exc:
                attempt += 1
                log.debug("watch broke; reconnecting", extra={"error": str(exc)})
                await asyncio.sleep(min(1.0, 0.1 * attempt))


class LeaseGone(EtcdUnavailable):
    """The lease expired or was revoked (the node must register again)."""

    code = "lease_gone"


class Compacted(Exception):
    """A watch asked for revisions etcd has compacted away."""

    def __init__(self, revision: int) -> None:
        super().__init__(f"revision compacted up to {revision}")
        self.revision = revision
