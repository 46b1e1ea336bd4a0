"""Teams in core: who may see a sandbox, what a team's creates count against.

A request made with a team's key (``hangar.teams``, ``hangar.keys``) runs with
that team **acting** (``acting_for``: a context variable the API sets once,
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

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hangar.errors import Conflict, LimitExceeded, NotFound, QuotaExceeded
from hangar.teams import Team, TeamStore

if TYPE_CHECKING:
    from hangar.core.context import Context
    from hangar.core.records import SandboxRecord

ACTING: ContextVar[str | None] = ContextVar("hangar_acting_team", default=None)
"""The team whose key made the request being served (None: an operator's, or none)."""


def _unit(unit: str, n: int) -> str:
    return unit.replace("sandboxes", "sandbox") if n == 1 else unit


def acting() -> str | None:
    """The team acting now, or None."""
    return ACTING.get()


def act_as(team: str | None) -> None:
    """Make ``team`` act for the rest of the current task (a request served in a task
    of its own; ``acting_for`` scopes a block instead)."""
    ACTING.set(team)


@contextmanager
def acting_for(team: str | None) -> Iterator[None]:
    """Run the block with ``team`` acting (tests, and callers outside a request)."""
    token = ACTING.set(team)
    try:
        yield
    finally:
        ACTING.reset(token)


@dataclass(frozen=True)
class Usage:
    """What a team holds: sandboxes with a VMM, their vCPUs and memory (MiB), and the
    disks of its sandboxes not gone (MiB)."""

    sandboxes: int = 0
    vcpus: int = 0
    memory_mib: int = 0
    disk_mib: int = 0


@dataclass(frozen=True)
class TeamView:
    """A team, its limits (None: none) and its usage now."""

    team: Team
    usage: Usage


def _usage(held: list[Any], disks: list[Any]) -> Usage:
    return Usage(len(held), sum(r.vcpus for r in held), sum(r.memory_mib for r in held),
                 sum(r.disk_mib for r in disks))


class Teams:
    """``m.teams``: the teams of this server (``<data>/teams.json``) and their use."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.store = TeamStore(ctx.layout.root / "teams.json")

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
        return _usage(*self._holdings(name))

    def refusal(self, rec: SandboxRecord) -> LimitExceeded | None:
        """The refusal of one more VMM for ``rec`` (a new record not yet written, or one
        about to start again) past its team's limits, or None."""
        if rec.team is None or not self.store.exists(rec.team):
            return None
        team = self.store.get(rec.team)
        held, disks = self._holdings(rec.team)
        have = _usage(held, disks)
        extra = 0 if any(r.id == rec.id for r in held) else 1
        new = not any(r.id == rec.id for r in disks) and self.ctx.store.get(rec.id) is None
        asks = (("max_sandboxes", have.sandboxes, extra, "sandboxes"),
                ("max_vcpus", have.vcpus, rec.vcpus * extra, "vCPUs"),
                ("max_memory_mib", have.memory_mib, rec.memory_mib * extra, "MiB of memory"),
                ("max_disk_mib", have.disk_mib, rec.disk_mib if new else 0, "MiB of disk"))
        for quota, used, need, unit in asks:
            limit = getattr(team, quota)
            if limit is not None and need and used + need > limit:
                return QuotaExceeded(
                    f"team {team.name} may hold {limit} {_unit(unit, limit)} ({quota}) and "
                    f"holds {used}; this sandbox needs {need} more", quota=quota,
                    limit=limit, used=used, needed=need, team=team.name)
        return None

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
        """Team ``name``; raises NotFound."""
        return TeamView(self.store.get(name), self.usage(name))

    def create(self, name: str, **limits: Any) -> TeamView:
        """A new team; raises InvalidRequest, Conflict, LimitExceeded."""
        return TeamView(self.store.create(name, **limits), Usage())

    def update(self, name: str, **limits: Any) -> TeamView:
        """Change team ``name``'s limits (None: no limit); raises InvalidRequest,
        NotFound. Sandboxes it holds past a lowered limit keep running."""
        return TeamView(self.store.update(name, **limits), self.usage(name))

    def remove(self, name: str) -> None:
        """Forget team ``name``. Raises NotFound, Conflict while it holds a sandbox or a
        key (``TeamStore.remove``)."""
        self.store.get(name)
        held = [r.id for r in self.ctx.store.live() if r.team == name]
        if held:
            raise Conflict(f"team {name} holds {len(held)} sandboxes; delete them first",
                           team=name, sandboxes=len(held))
        self.store.remove(name)
