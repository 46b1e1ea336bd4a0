"""Teams in a cluster: their records and keys in etcd, and quotas counted cluster-wide.

A single host keeps its teams in ``<data>/teams.json`` and its keys in
``<data>/api-keys`` (``hangar.teams``, ``hangar.keys``). A cluster keeps both
in etcd, so every node knows every team and accepts every team's key::

    /hangar/teams/<name>     {"created", "max_sandboxes", ... }      (TeamRecord)
    /hangar/keys/<name>      {"sha256": HEX, "team": T, "created"}   (KeyRecord)
    /hangar/quota/<team>     a counter, bumped by every create and wake of the team

Each node's directory watch caches both (``Directory.teams``, ``.keys``): the
core reads its teams from the cache (``SharedTeamStore``, given to
``Teams.use_store``) and the key ring accepts the keys (``KeyRing
.share_team_keys``, under ``NAME@cluster``). The cluster's operator keys stay
the config's ``key_hashes``; ``/hangar/keys/`` holds team keys only.

**Quotas hold cluster-wide** (``quota_guard``). A create of a team whose
limits bound sandboxes, vCPUs, memory or disk reads, in this order, the team's
counter, its record and every sandbox record, counts what the team holds on
every node (``usage``: records in the states that hold a VMM, and the disks of
those not gone) and refuses past a limit with the very 429 of one host
(``quota_refusal``). Otherwise the claim's one transaction (slot, record,
machine key) also compares the counter's and the team record's revisions and
bumps the counter. Any create of the team committed before the counter was
read is in the records read after it; any committed after changed the counter,
so this one fails and is counted again: creates sent at once through any nodes
cannot pass a limit together. A wake's slot claim (``ClusterNode.claim_slot``)
is counted the same way (its disk is already). A team without such limits
takes no counter (its creates do not contend).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from hangar.cluster import records as R, team_records as TR
from hangar.cluster.directory import Directory
from hangar.cluster.etcd import Etcd, cmp_mod, cmp_version, op_delete, op_put
from hangar.cluster.records import BadRecord, SandboxObject
from hangar.core.service import GONE, Usage, quota_refusal, removal_refusal
from hangar.errors import Conflict, InvalidRequest, NotFound
from hangar.keys import DEFAULT_NAME, NAME as KEY_NAME, digest, fingerprint, generate, \
    generate_e2b
from hangar.teams import Team, TeamStore, check_limits, check_name

COUNTED = ("max_sandboxes", "max_vcpus", "max_memory_mib", "max_disk_mib")
"""The limits a create is checked against cluster-wide (volumes are a node's own)."""
QUOTA_TRIES = 40
"""Times a create is counted again after another create of its team won the race."""
T = TypeVar("T")


class SharedTeamStore(TeamStore):
    """The core's team store on a node (``Teams.use_store``): the teams of the directory's
    cache of ``/hangar/teams/``. Changes go through etcd (``create_team`` and the rest,
    which the gateway calls for ``/teams``), never through this object."""

    def __init__(self, directory: Directory) -> None:
        super().__init__(Path("/nonexistent/teams.json"))
        self.directory = directory

    def all(self) -> list[Team]:
        return [t for _, t in sorted(self.directory.teams.items())]

    def get(self, name: str) -> Team:
        team = self.directory.teams.get(name)
        if team is None:
            raise NotFound(f"no team {name[:80]!r}", team=name[:80])
        return team

    def exists(self, name: str) -> bool:
        return name in self.directory.teams

    def keys_of(self, name: str) -> list[str]:
        return sorted(n for n, k in self.directory.keys.items() if k.team == name)

    def _refuse(self, *_: Any, **__: Any) -> Any:
        raise Conflict("a cluster's teams are kept in etcd: change them through a node's "
                       "/teams (hangar team ...)")

    create = update = remove = _refuse  # type: ignore[assignment]


# -- use ------------------------------------------------------------------------------------

def shape(rec: SandboxObject) -> tuple[int, int, int]:
    """(vCPUs, memory MiB, disk MiB) of a record's ``spec.template`` (0 for a missing one)."""
    t = rec.spec.get("template") or {}

    def n(k: str) -> int:
        v = t.get(k)
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0
    return n("vcpus"), n("memoryMiB"), n("diskMiB")


def usage(team: str, records: Iterable[SandboxObject]) -> Usage:
    """What ``team`` holds by the records: sandboxes in a state that holds a VMM, their
    vCPUs and memory, and the disks of those not gone (``volumes_mib`` 0: a node's own)."""
    n = vcpus = mem = disk = 0
    for r in records:
        if r.team != team or r.state in GONE:
            continue
        v, m, d = shape(r)
        disk += d
        if r.state in R.VMM_HOLDING:
            n, vcpus, mem = n + 1, vcpus + v, mem + m
    return Usage(n, vcpus, mem, disk)


def parse_records(kvs: Iterable[Any]) -> list[SandboxObject]:
    """The readable sandbox records among ``kvs`` (an unreadable one counts nothing)."""
    out = []
    for kv in kvs:
        try:
            sid = R.key_id(kv.key, R.SANDBOXES, R.SANDBOX_ID)
            out.append(SandboxObject.parse(R.load_json(kv.value), kv.mod_revision, sid=sid))
        except BadRecord:
            continue
    return out


async def read_team(etcd: Etcd, name: str) -> tuple[Team, Any]:
    """Team ``name`` and its KV read from etcd now. Raises NotFound, Conflict (unreadable)."""
    kv = await etcd.get(R.team_key(name)) if R.TEAM_NAME.fullmatch(name) else None
    if kv is None:
        raise NotFound(f"no team {name[:80]!r}", team=name[:80])
    try:
        return TR.team_record(name, R.load_json(kv.value)), kv
    except BadRecord as exc:
        raise Conflict(f"team {name}'s cluster record is unreadable ({exc}); an operator "
                       f"must fix or delete {R.team_key(name)}", team=name) from None


async def quota_guard(etcd: Etcd, team: str, need: Usage) -> tuple[list[Any], list[Any]]:
    """The compares and puts that hold ``team``'s limits for one more sandbox needing
    ``need``, for the claim's transaction (the module docstring); none for a team whose
    limits bound nothing counted here. Raises QuotaExceeded (429) past a limit, NotFound
    for a team gone, Conflict for an unreadable team record."""
    qkey = R.quota_key(team)
    qkv = await etcd.get(qkey)
    t, tkv = await read_team(etcd, team)
    if all(getattr(t, k) is None for k in COUNTED):
        return [], []
    kvs, _ = await etcd.get_prefix(R.SANDBOXES)
    refusal = quota_refusal(t, usage(team, parse_records(kvs)), need)
    if refusal is not None:
        raise refusal
    count = TR.quota_count(qkv.value) if qkv is not None else 0
    compare = [cmp_mod(qkey, qkv.mod_revision) if qkv is not None else cmp_version(qkey, 0),
               cmp_mod(R.team_key(team), tkv.mod_revision)]
    return compare, [op_put(qkey, str(count + 1))]


async def within_quota(etcd: Etcd, team: str | None, need: Usage,
                       attempt: Callable[[list[Any], list[Any]], Awaitable[T]]) -> T:
    """``attempt(compare, ops)`` (a claim's transaction, with ``quota_guard``'s compares and
    puts added) for one more sandbox of ``team`` needing ``need``; when another create of
    the team won the race (the counter moved), counted again, up to ``QUOTA_TRIES`` times.
    ``team`` None: the operator's, no quota. Raises QuotaExceeded (429), and what
    ``attempt`` raises (a Conflict of its own compares as is)."""
    for i in range(QUOTA_TRIES):
        compare, ops = await quota_guard(etcd, team, need) if team else ([], [])
        try:
            return await attempt(compare, ops)
        except Conflict:
            if not compare or i == QUOTA_TRIES - 1 or (await etcd.txn(compare, [], []))[0]:
                raise
        await asyncio.sleep(random.uniform(0.0, 0.02 * (i + 1)))
    raise AssertionError("unreachable")


# -- teams ----------------------------------------------------------------------------------

async def create_team(etcd: Etcd, name: str, limits: dict[str, Any]) -> Team:
    """Make team ``name``. Raises InvalidRequest, Conflict (the name exists)."""
    check_name(name)
    team = Team(name, time.time(), **check_limits(limits))
    ok, _ = await etcd.txn([cmp_version(R.team_key(name), 0)],
                           [op_put(R.team_key(name), TR.team_json(team))])
    if not ok:
        raise Conflict(f"a team called {name!r} exists", team=name)
    return team


async def update_team(etcd: Etcd, name: str, limits: dict[str, Any]) -> Team:
    """Change the limits named in ``limits`` (None: no limit). Raises InvalidRequest,
    NotFound, Conflict."""
    checked = check_limits(limits)
    for _ in range(8):
        old, kv = await read_team(etcd, name)
        team = Team(name, old.created, **{**old.limits(), **checked})
        ok, _ = await etcd.txn([cmp_mod(R.team_key(name), kv.mod_revision)],
                               [op_put(R.team_key(name), TR.team_json(team))])
        if ok:
            return team
    raise Conflict(f"team {name}'s record keeps changing; retry", team=name)


async def remove_team(etcd: Etcd, name: str, held: dict[str, int]) -> None:
    """Delete team ``name``. Raises NotFound, Conflict while a key of it is in etcd, a
    sandbox of it is on any node, or ``held`` (what the answering node holds of it, by
    kind) is not empty: a team made again under the name would take them over."""
    _, kv = await read_team(etcd, name)
    keys = sorted(k for k, rec in (await list_keys(etcd)).items() if rec.team == name)
    kvs, _ = await etcd.get_prefix(R.SANDBOXES)
    sandboxes = sum(1 for r in parse_records(kvs) if r.team == name and r.state not in GONE)
    held = {**held, "sandboxes": max(sandboxes, held.get("sandboxes", 0))}
    refused = removal_refusal(name, {k: n for k, n in held.items() if n}, keys)
    if refused is not None:
        raise refused
    ok, _ = await etcd.txn([cmp_mod(R.team_key(name), kv.mod_revision)],
                           [op_delete(R.team_key(name)), op_delete(R.quota_key(name))])
    if not ok:
        raise Conflict(f"team {name} changed meanwhile (a key added?); retry", team=name)


# -- keys -----------------------------------------------------------------------------------

async def list_keys(etcd: Etcd) -> dict[str, TR.KeyRecord]:
    """Every readable team key in etcd, by name."""
    kvs, _ = await etcd.get_prefix(R.KEYS)
    out = {}
    for kv in kvs:
        try:
            out[kv.key[len(R.KEYS):]] = TR.key_record(kv.key[len(R.KEYS):], R.load_json(kv.value))
        except BadRecord:
            continue
    return out


async def add_key(etcd: Etcd, name: str, team: str, e2b: bool = False) -> str:
    """Make key ``name`` of ``team`` and return it (only its SHA-256 is stored). Raises
    InvalidRequest, NotFound (no such team), Conflict (the name exists)."""
    if not KEY_NAME.fullmatch(name) or name == DEFAULT_NAME:
        raise InvalidRequest(f"key name {name[:80]!r} must be 1-64 of a-z, 0-9, '.', '_', '-', "
                             "starting with a letter or digit (and not 'default')")
    check_name(team)
    key = generate_e2b() if e2b else generate()
    body = {"sha256": digest(key).hex(), "team": team, "created": time.time()}
    for _ in range(8):
        try:
            t, tkv = await read_team(etcd, team)
        except NotFound:
            raise NotFound(f"no team {team!r}; `hangar team create {team}` makes one",
                           team=team) from None
        # The team's record is written again (same value): a removal of the team that read
        # it before this key existed then fails its compare.
        ok, _ = await etcd.txn([cmp_mod(R.team_key(team), tkv.mod_revision),
                                cmp_version(R.key_key(name), 0)],
                               [op_put(R.key_key(name), body),
                                op_put(R.team_key(team), TR.team_json(t))])
        if ok:
            return key
        if await etcd.get(R.key_key(name)) is not None:
            raise Conflict(f"a key called {name!r} exists in the cluster; `hangar key rm "
                           f"{name}` first")
    raise Conflict(f"team {team}'s record keeps changing; retry", team=team)


async def remove_key(etcd: Etcd, name: str) -> None:
    """Delete team key ``name``; it stops working on every node. Raises NotFound."""
    if not KEY_NAME.fullmatch(name) or not await etcd.delete(R.key_key(name)):
        raise NotFound(f"no key called {name[:80]!r} in the cluster")


def key_rows(keys: dict[str, TR.KeyRecord]) -> list[tuple[str, str, float, str]]:
    """(name, fingerprint, created, team) of each key, by name (never the key)."""
    return [(n, fingerprint(bytes.fromhex(k.sha256)), k.created, k.team)
            for n, k in sorted(keys.items())]

