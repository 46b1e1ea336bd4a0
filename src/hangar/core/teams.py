"""Teams in core: who may see a sandbox, what a team's creates count against.

A request made with a team's key (``hangar.teams``, ``hangar.keys``) runs with
that team **acting** (``hangar.core.acting``: a context variable the API sets once,
before the route, from the key; tasks the request starts inherit it):

* ``check(sandbox_id)``: a sandbox of another team, or of the operator, is
  ``NotFound`` with the very message of a missing one, so ids leak nothing;
* ``SandboxManager.list`` shows the acting team's sandboxes only;
* creates and forks (``SandboxManager.create``, ``provision``, ``fork``) stamp
  the record with the acting team (its ``team`` column; None: the operator's);
* admission (``hangar.core.admission.Admission.slot``) refuses a create, fork,
  restore or wake that would take the record's team past one of its limits
  (``refusal``): ``QuotaExceeded`` (429 without ``Retry-After``: waiting does
  not help, so clients do not retry) naming the quota, its limit and the team's use, checked and written under admission's lock, so creates sent at
  once cannot pass a limit together.

With no team acting (an operator key, the server's own work) everything is
visible and nothing is counted per team. Usage counts what holds a VMM
(sandboxes, vCPUs, memory: the states admission counts) and the disks of
every sandbox not yet gone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from hangar.core.acting import acting
from hangar.core.records import SnapshotRecord, VolumeRecord
from hangar.errors import Conflict, LimitExceeded, NotFound, QuotaExceeded
from hangar.teams import Team, TeamStore

if TYPE_CHECKING:
    from hangar.core.context import Context
    from hangar.core.records import SandboxRecord


SCOPE_SEP = "/"
"""Between a team's name and a name it gave (``scoped``): no resource's name may hold it."""


def scoped(name: str, team: str | None = None) -> str:
    """The name stored for ``name`` given by the acting team (or ``team``):
    ``TEAM/name`` for a team, ``name`` itself for the operator. Names that are unique
    on the server (volumes, secrets, machines' users, template aliases) are so per team:
    two teams may each have a volume ``data``, and neither learns of the other's."""
    who = team if team is not None else acting()
    return name if who is None else f"{who}{SCOPE_SEP}{name}"


def unscoped(stored: str) -> str:
    """A stored name as the acting team calls it: without its ``TEAM/`` when a team
    acts; whole (``TEAM/name`` for a team's) for the operator."""
    who = acting()
    prefix = f"{who}{SCOPE_SEP}" if who is not None else None
    return stored[len(prefix):] if prefix and stored.startswith(prefix) else stored


def owner_of(stored: str) -> str | None:
    """The team a stored name (``scoped``) belongs to, or None: the operator's."""
    head, sep, _ = stored.partition(SCOPE_SEP)
    return head if sep else None


def name_visible(stored: str) -> bool:
    """Whether the acting team may see the resource stored under ``stored``."""
    who = acting()
    return who is None or owner_of(stored) == who


SINGULAR = {"sandboxes": "sandbox", "snapshots": "snapshot", "volumes": "volume",
            "secrets": "secret", "machines": "machine", "templates": "template"}
"""Each kind ``Teams.holdings`` counts, as one of it is named."""

OWNERS_KEPT = 4096
"""Sandboxes whose team ``Teams.owner`` keeps (events ask it for each one's team)."""


def _unit(unit: str, n: int) -> str:
    return unit.replace("sandboxes", "sandbox") if n == 1 else unit


@dataclass(frozen=True)
class Usage:
    """What a team holds: sandboxes with a VMM, their vCPUs and memory (MiB), the
    disks of its sandboxes not gone (MiB), and the sizes of its named volumes (MiB)."""

    sandboxes: int = 0
    vcpus: int = 0
    memory_mib: int = 0
    disk_mib: int = 0
    volumes_mib: int = 0


@dataclass(frozen=True)
class TeamView:
    """A team, its limits (None: none) and its usage now."""

    team: Team
    usage: Usage


def _usage(held: list[Any], disks: list[Any]) -> Usage:
    return Usage(len(held), sum(r.vcpus for r in held), sum(r.memory_mib for r in held),
                 sum(r.disk_mib for r in disks))


def removal_refusal(name: str, held: dict[str, int], keys: list[str]) -> Conflict | None:
    """The 409 refusing to remove team ``name`` while it holds resources (``held``:
    ``{kind: how many}``, zeros left out) or keys (their names), or None when it holds
    nothing. The one wording, on one host and in a cluster."""
    if not held and not keys:
        return None
    what = [f"{n} {kind if n != 1 else SINGULAR.get(kind, kind)}" for kind, n in held.items()]
    if keys:
        what.append(f"{len(keys)} {'keys' if len(keys) != 1 else 'key'} "
                    f"({', '.join(keys[:10])}: hangar key rm NAME)")
    return Conflict(f"team {name} holds {', '.join(what)}; delete them first",
                    team=name, **held, **({"keys": len(keys)} if keys else {}))


def quota_refusal(team: Team, have: Usage, need: Usage) -> QuotaExceeded | None:
    """The refusal of ``need`` (one more sandbox: its VMM, vCPUs, memory, and its disk
    when new) on top of what ``team`` holds (``have``) past one of its limits, or None.
    The one wording of a quota's 429, on one host and in a cluster
    (``hangar.cluster.teams``)."""
    asks = (("max_sandboxes", have.sandboxes, need.sandboxes, "sandboxes"),
            ("max_vcpus", have.vcpus, need.vcpus, "vCPUs"),
            ("max_memory_mib", have.memory_mib, need.memory_mib, "MiB of memory"),
            ("max_disk_mib", have.disk_mib, need.disk_mib, "MiB of disk"))
    for quota, used, n, unit in asks:
        limit = getattr(team, quota)
        if limit is not None and n and used + n > limit:
            return QuotaExceeded(
                f"team {team.name} may hold {limit} {_unit(unit, limit)} ({quota}) and "
                f"holds {used}; this sandbox needs {n} more", quota=quota,
                limit=limit, used=used, needed=n, team=team.name)
    return None


class Teams:
    """``m.teams``: the teams of this server (``<data>/teams.json``) and their use."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.store = TeamStore(ctx.layout.root / "teams.json")
        self._owners: dict[str, str | None] = {}
        self._counters: dict[str, Callable[[str], int]] = {"volumes": self._volumes}
        ctx.events.owner = self.owner

    def use_store(self, store: TeamStore) -> None:
        """Keep the teams in ``store`` instead of ``<data>/teams.json`` (a cluster's node:
        its teams are in etcd, ``hangar.cluster.teams``)."""
        self.store = store

    def owner(self, sandbox_id: str) -> str | None:
        """The team of sandbox ``sandbox_id`` (None: the operator's, or unknown). A
        sandbox's team never changes, so answers are kept (at most ``OWNERS_KEPT``)."""
        if sandbox_id in self._owners:
            return self._owners[sandbox_id]
        rec = self.ctx.store.get(sandbox_id)
        if rec is None:
            return None
        if len(self._owners) >= OWNERS_KEPT:
            self._owners.clear()
        self._owners[sandbox_id] = rec.team
        return rec.team

    # -- ownership ---------------------------------------------------------------------

    @staticmethod
    def visible(rec: Any, team: str | None = None) -> bool:
        """Whether the acting team (or ``team``) may see ``rec`` (a record or a view)."""
        who = team if team is not None else acting()
        return who is None or getattr(rec, "team", None) == who

    def check(self, sandbox_id: str) -> None:
        """Raise NotFound, worded as for a missing sandbox, unless the acting team may see
        ``sandbox_id`` (a missing one is left to the verb that reads it)."""
        who = acting()
        if who is None:
            return
        rec = self.ctx.store.get(sandbox_id)
        if rec is not None and rec.team != who:
            raise NotFound(f"no sandbox {sandbox_id}", sandbox_id=sandbox_id)

    # -- quotas ------------------------------------------------------------------------

    def _holdings(self, name: str) -> tuple[list[SandboxRecord], list[SandboxRecord]]:
        """Team ``name``'s records that hold a VMM, and those not gone (one read each)."""
        store = self.ctx.store
        return ([r for r in store.with_vmm() if r.team == name],
                [r for r in store.live() if r.team == name])

    def usage(self, name: str) -> Usage:
        """What team ``name`` holds now."""
        return replace(_usage(*self._holdings(name)), volumes_mib=self.volumes_mib(name))

    def _volumes(self, name: str) -> int:
        return sum(1 for v in self.ctx.store.list(VolumeRecord) if owner_of(v.name) == name)

    def volumes_mib(self, name: str) -> int:
        """The sizes of team ``name``'s named volumes together, MiB (``hangar.core.volumes``:
        a team's are stored as ``TEAM/name``)."""
        return sum(v.size_mib for v in self.ctx.store.list(VolumeRecord)
                   if owner_of(v.name) == name)

    def refusal(self, rec: SandboxRecord) -> LimitExceeded | None:
        """The refusal of one more VMM for ``rec`` (a new record not yet written, or one
        about to start again) past its team's limits, or None."""
        if rec.team is None or not self.store.exists(rec.team):
            return None
        team = self.store.get(rec.team)
        held, disks = self._holdings(rec.team)
        extra = 0 if any(r.id == rec.id for r in held) else 1
        new = not any(r.id == rec.id for r in disks) and self.ctx.store.get(rec.id) is None
        return quota_refusal(team, _usage(held, disks),
                             Usage(extra, rec.vcpus * extra, rec.memory_mib * extra,
                                   rec.disk_mib if new else 0))

    def figures(self) -> dict[str, tuple[int, int, int]]:
        """``{team: (sandboxes, vCPUs, memory MiB)}`` of what holds a VMM, every team
        listed (``/metrics``; one read of the records)."""
        out = {t.name: (0, 0, 0) for t in self.store.all()}
        for r in self.ctx.store.with_vmm():
            if r.team is not None:
                n, cpu, mem = out.get(r.team, (0, 0, 0))
                out[r.team] = (n + 1, cpu + r.vcpus, mem + r.memory_mib)
        return out

    # -- the operator's verbs ----------------------------------------------------------

    def list(self) -> list[TeamView]:
        """Every team with its usage, by name."""
        return [TeamView(t, self.usage(t.name)) for t in self.store.all()]

    def get(self, name: str) -> TeamView:
        """Team ``name``; raises NotFound (also for another team than the acting one,
        worded as for a missing one)."""
        who = acting()
        if who is not None and name != who:
            raise NotFound(f"no team {name[:80]!r}", team=name[:80])
        return TeamView(self.store.get(name), self.usage(name))

    def exists(self, name: str) -> bool:
        """Whether team ``name`` exists (for the operator's ``X-Hangar-Team``)."""
        return self.store.exists(name)

    def started(self, name: str, since: float) -> int:
        """How many sandboxes team ``name`` started since ``since`` (Unix seconds) that
        the server still has a record of (tombstones are kept a while: ``purge``)."""
        return sum(1 for r in self.ctx.store.all() if r.team == name and r.created_at >= since)

    def create(self, name: str, **limits: Any) -> TeamView:
        """A new team; raises InvalidRequest, Conflict, LimitExceeded."""
        return TeamView(self.store.create(name, **limits), Usage())

    def update(self, name: str, **limits: Any) -> TeamView:
        """Change team ``name``'s limits (None: no limit); raises InvalidRequest,
        NotFound. Sandboxes it holds past a lowered limit keep running."""
        return TeamView(self.store.update(name, **limits), self.usage(name))

    def holdings(self, name: str) -> dict[str, int]:
        """What team ``name`` holds, by kind (``{"sandboxes": 2, "volumes": 1}``; kinds it
        holds none of left out): its sandboxes not gone, its snapshots, and what the parts
        that keep its names count (``count``)."""
        store = self.ctx.store
        counts = {"sandboxes": sum(1 for r in store.live() if r.team == name),
                  "snapshots": sum(1 for s in store.list(SnapshotRecord)
                                   if s.team == name and s.kind == "user")}
        for kind, counter in self._counters.items():
            counts[kind] = counter(name)
        return {kind: n for kind, n in counts.items() if n}

    def count(self, kind: str, counter: Callable[[str], int]) -> None:
        """Let ``counter(team)`` say how many of ``kind`` a team holds (volumes, secrets,
        machines, templates: the parts that keep a team's names call this once)."""
        self._counters[kind] = counter

    def remove(self, name: str) -> None:
        """Forget team ``name``. Raises NotFound, Conflict while it holds anything
        (``holdings``: a team made again under its name would take it over) or a key
        (``TeamStore.remove``)."""
        self.store.get(name)
        refused = removal_refusal(name, self.holdings(name), self.store.keys_of(name))
        if refused is not None:
            raise refused
        self.store.remove(name)
