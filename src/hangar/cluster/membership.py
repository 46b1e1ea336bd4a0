"""Membership: a node's lease, its record, renewal, fencing and the reconciler election.

A node registers ``/hangar/nodes/<name>`` under a lease of
``lease_ttl_s`` seconds (5 by default) and renews it every second,
rewriting its record (free slots, images...) every few seconds. When its
lease expires (the node died, or is cut off), the record vanishes and the
elected reconciler (``hangar.cluster.failover``) hands its sandboxes on.

Fencing. A node that has not renewed its lease for ``lease_ttl_s - 1.5``
seconds asks its peers (``GET /cluster/health``, with the node token):

* no peer answers, or one answers that *it* can write to etcd: this node
  is cut off while the others go on, and they will give its machines to
  other nodes once its lease is gone: it stops every VMM it runs now
  (``on_fence``), before that can happen;
* peers answer and none can write to etcd: quorum is lost everywhere,
  nobody can move anything (and etcd's next leader extends every lease),
  so the node keeps its VMs running and serving; control writes get 503.
  While it holds so, a round in which no peer answers (each has
  ``PEER_TIMEOUT_S``; a busy host's peers can miss one) does not fence it at
  once: the last round in which peers said that none could write stands for
  a renewal, and the node fences only when no peer has answered for
  ``lease_ttl_s - 1.5`` seconds after it. Quorum came back after that round,
  and etcd's new leader then extended every lease by its TTL, so the node
  still stops its VMMs before anybody could hand them on.

A node whose lease etcd says is gone although etcd answers (quorum came
back, or a paused leader revoked it) registers again at once without
fencing: nobody can have moved its sandboxes before etcd answered again and
the failover's margin passed. A fenced node keeps trying to register
again; once it has a lease it runs ``on_rejoin`` (which kills VMMs whose epoch is stale) before it
takes new work.

A graceful stop (SIGTERM: a restart, an upgrade) leaves a restart mark,
``/hangar/restarts/<name>``, under a lease of its own of ``restart_grace_s``
seconds (``mark_restart``): while the mark lasts (at most that long from when the
reconciler saw the node lost), the failover waits for the node to come back rather
than ``failover_after_s``, since its VMMs outlive the server and a start that
takes longer than the lease (a loaded host, many sandboxes to adopt) must not
cost them. The node deletes its mark when it
registers again, so a crash later is handed on at the usual pace. A mark
nobody deletes ends with its lease; one forged without a lease delays a
failover by at most ``restart_grace_s`` (the reconciler's own setting), and
goes when the node registers.

Election: the node that puts ``/hangar/leader`` (value: its name, under
its lease) when the key is absent runs the failover reconciler; when its
lease ends, the key goes with it and another node takes over.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import httpx

from hangar.cluster import records as R
from hangar.cluster.directory import Directory
from hangar.cluster.etcd import Etcd, EtcdUnavailable, LeaseGone, cmp_version, op_put
from hangar.cluster.forwarding import H_TOKEN
from hangar.cluster.records import NodeInfo
from hangar.core.service import Tasks, every

log = logging.getLogger("hangar.cluster.membership")

RENEW_S = 1.0
"""Seconds between lease renewals."""
REFRESH_S = 3.0
"""Seconds between rewrites of the node's record (free slots, images)."""
PEER_TIMEOUT_S = 0.7
"""How long a peer has to answer ``/cluster/health`` when the lease cannot be renewed."""
RENEW_DEADLINE_S = 1.2
"""A renewal that has not completed in this many seconds (every member tried) failed."""
FENCE_MARGIN_S = 1.5
"""A node decides whether to fence this many seconds before its lease would expire."""


class Membership:
    """One node's lease, record and fencing."""

    def __init__(self, etcd: Etcd, directory: Directory, name: str, ttl: int,
                 info: Callable[[], NodeInfo], on_fence: Callable[[str], Awaitable[None]],
                 on_rejoin: Callable[[], Awaitable[None]],
                 token: Callable[[], str] = lambda: "") -> None:
        self.etcd = etcd
        self.directory = directory
        self.name = name
        self.ttl = ttl
        self.info = info
        self.on_fence = on_fence
        self.on_rejoin = on_rejoin
        self.token = token
        """The node token (``X-Hangar-Node-Token``): peers answer the probe only with it."""
        self.lease = 0
        self.last_ok = 0.0
        """Monotonic time the lease was last renewed (sent time of the renewal)."""
        self.fenced = False
        self.leader = False
        self.quorum_lost = False
        """True while neither this node nor any peer can write to etcd (holding, not fenced)."""
        self._tasks = Tasks("membership")
        self._last_refresh = 0.0
        self._quorum_back = 0.0
        self._held_at = 0.0
        """When peers last answered that none of them could write (quorum lost everywhere)."""
        """Monotonic time this node saw quorum return while its own renewal lagged: the
        fence is counted from the later of this and ``last_ok`` (see ``_decide``)."""
        self._http = httpx.AsyncClient(timeout=PEER_TIMEOUT_S)

    def writable(self) -> bool:
        """True while the lease was renewed within the last two renewals: etcd takes writes."""
        return not self.fenced and time.monotonic() - self.last_ok < 2.5 * RENEW_S

    async def register(self) -> None:
        """Grant a lease and write this node's record under it. Raises EtcdUnavailable."""
        sent = time.monotonic()
        self.lease = await self.etcd.grant(self.ttl)
        await self.etcd.put(R.node_key(self.name), self.info().to_json(), lease=self.lease)
        self.last_ok = sent
        self._last_refresh = sent
        log.info("node registered", extra={"node": self.name, "lease": f"{self.lease:x}"})
        try:
            await self.etcd.delete(R.restart_key(self.name))  # back: no grace for a crash now
        except EtcdUnavailable:
            pass  # the mark ends with its own lease

    async def mark_restart(self, grace_s: int) -> None:
        """Before a graceful stop: write this node's restart mark under a lease of
        ``grace_s`` seconds (module docstring). Skipped when ``grace_s`` is 0 or the node
        cannot write (fenced, etcd away); best effort within ``2 * RENEW_DEADLINE_S``."""
        if grace_s <= 0 or not self.writable():
            return

        async def put() -> None:
            lease = await self.etcd.grant(grace_s)
            await self.etcd.put(R.restart_key(self.name), {"node": self.name}, lease=lease)

        try:
            await asyncio.wait_for(put(), 2 * RENEW_DEADLINE_S)
        except (EtcdUnavailable, asyncio.TimeoutError):
            log.warning("restart mark not written: the failover will not wait for this node",
                        extra={"node": self.name})
            return
        log.info("restart mark written", extra={"node": self.name, "grace_s": grace_s})

    def start(self) -> None:
        self._tasks.start("run", every(RENEW_S, self._step, log, "membership step failed"))

    async def close(self) -> None:
        """Stop renewing (the lease then expires by itself: VMMs outlive a restart)."""
        await self._tasks.stop()
        await self._http.aclose()

    async def _step(self) -> None:
        sent = time.monotonic()
        if self.fenced or not self.lease:
            try:
                await self.register()
            except EtcdUnavailable:
                return
            self.fenced = False
            self.quorum_lost = False
            await self.on_rejoin()
            return
        try:
            try:
                # A member that hangs (stopped, partitioned) must leave time for the others.
                per = RENEW_DEADLINE_S / max(1, len(self.etcd.endpoints))
                await asyncio.wait_for(self.etcd.keepalive(self.lease, timeout=per),
                                       RENEW_DEADLINE_S)
            except asyncio.TimeoutError:
                raise EtcdUnavailable("lease renewal timed out") from None
            if sent - self._last_refresh >= REFRESH_S:
                await self.etcd.put(R.node_key(self.name), self.info().to_json(),
                                    lease=self.lease)
                self._last_refresh = sent
            self.last_ok = sent
            self.quorum_lost = False
            await self._elect()
        except LeaseGone:
            # Etcd answers again but revoked the lease (a leader that was paused past it,
            # or quorum back after a long loss). Register anew and rejoin: only sandboxes
            # whose records moved meanwhile are stale, and rejoin kills exactly those.
            log.warning("lease gone while etcd answers: registering again",
                        extra={"node": self.name})
            self.lease = 0
        except EtcdUnavailable:
            since = max(self.last_ok, self._quorum_back)
            if time.monotonic() - since >= self.ttl - FENCE_MARGIN_S:
                await self._decide()

    async def refresh_now(self) -> None:
        """Rewrite this node's record at once (a drain, a slot change)."""
        if self.lease and not self.fenced:
            await self.etcd.put(R.node_key(self.name), self.info().to_json(), lease=self.lease)

    async def _elect(self) -> None:
        if self.directory.leader == self.name:
            self.leader = True
            return
        self.leader = False
        if self.directory.leader is None:
            ok, _ = await self.etcd.txn([cmp_version(R.LEADER, 0)],
                                        [op_put(R.LEADER, self.name, lease=self.lease)])
            if ok:
                self.leader = True
                self.directory.leader = self.name
                log.info("elected to run the failover reconciler", extra={"node": self.name})

    async def peers_can_write(self) -> tuple[int, int]:
        """(peers that answered, peers that can write to etcd) among the known nodes."""
        peers = [n for name, n in self.directory.nodes.items() if name != self.name]

        async def ask(n: NodeInfo) -> bool | None:
            try:
                r = await self._http.get(f"{n.url}/cluster/health",
                                         headers={H_TOKEN: self.token()})
                if r.status_code != 200:  # a refusal is no answer: the safe side is to fence
                    return None
                return r.json().get("writable") is True
            except (httpx.HTTPError, ValueError, AttributeError):
                return None

        answers = await asyncio.gather(*(ask(n) for n in peers))
        got = [a for a in answers if a is not None]
        return len(got), sum(1 for a in got if a)

    async def _decide(self) -> None:
        answered, writable = await self.peers_can_write()
        if answered and not writable:
            self._held_at = time.monotonic()
            if not self.quorum_lost:
                log.warning("etcd has no quorum anywhere; holding every VM (control writes "
                            "get 503)", extra={"node": self.name, "peers": answered})
            self.quorum_lost = True
            return
        if writable and self.quorum_lost:
            # Quorum is back and a peer renewed first: this node's renewal is merely behind.
            # Etcd's new leader extended every lease by its TTL when it took over, so nobody
            # can hand this node's machines on for a TTL yet: count the fence from now.
            self.quorum_lost = False
            self._quorum_back = time.monotonic() - RENEW_DEADLINE_S
            log.info("etcd has quorum again; renewing this node's lease",
                     extra={"node": self.name})
            return
        if not answered and self.quorum_lost \
                and time.monotonic() - self._held_at < self.ttl - FENCE_MARGIN_S:
            log.warning("no peer answered while etcd has no quorum; holding (the last "
                        "answer said nobody can write)", extra={"node": self.name})
            return  # see the module docstring: the last "nobody writes" stands for a renewal
        why = ("no peer answers: this node is cut off" if not answered
               else "peers can write to etcd but this node cannot")
        await self._fence(why)

    async def _fence(self, why: str) -> None:
        if self.fenced:
            return
        self.fenced = True
        self.leader = False
        log.error("fencing: stopping every VMM of this node", extra={"node": self.name,
                                                                      "reason": why})
        try:
            await self.on_fence(why)
        except Exception:
            log.exception("fencing failed")
