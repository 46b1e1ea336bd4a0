"""Per-user persistent machines: one sandbox per user that sleeps when idle.

A machine is a sandbox with an idle timeout, found by its user's id. Its
states are the sandbox's, named for users::

    creating → active → snapshotting → sleeping → waking → active
                 (also: failed)

The desired state (``active`` or ``sleeping``) is stored beside the
current one on the sandbox record; ``SandboxManager.reconcile`` moves one
toward the other, and puts a machine idle for ``idle_timeout_s`` (default
``HANGAR_MACHINE_IDLE_S``, 30 min) to sleep. Exec and file calls to a
sleeping machine's sandbox wake it first, so callers never manage sleep.
Sleeping machines hold no VMM and do not count against the VM cap.

Machines belong to teams (``hangar.core.teams``): a team's machine of user
``alice`` is stored (its record's key, its sandbox's ``user_id``) as
``TEAM/alice`` (``scoped``) and shown as ``alice``; its sandbox is the team's.
Another team's user of the same id is another machine; a machine of another
team is missing (404) to a team's key and absent from its list. The operator
sees every machine, a team's by its stored name.

``MachineManager.reconcile`` (a pass of the reconcile loop) keeps the
machine records true: a record whose sandbox is gone is removed, and a
machine's sandbox without a record (a server killed between creating the
sandbox and recording the machine) becomes the user's machine, or is
deleted when the user already has another.
"""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
import logging
import re
import time
from dataclasses import dataclass

from hangar.core.admission import CreateOptions
from hangar.core.handover import Placement
from hangar.core.lifecycle import GONE, LIVE, PUBLIC, Face, State, public_name
from hangar.core.sandboxes import SandboxManager
from hangar.core.store import MachineRecord, SandboxRecord
from hangar.core.teams import name_visible, owner_of, scoped, unscoped
from hangar.errors import HangarError, InvalidRequest, NotFound

log = logging.getLogger("hangar.machines")

USER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$")

NAMES = {s: n.machine for s, n in PUBLIC.items()}
"""A machine's state names: the machine column of ``lifecycle.PUBLIC``."""


def desired_name(desired: State) -> str:
    """A machine's desired state as shown: ``sleeping`` or ``active``."""
    return public_name(State.SLEEPING if desired == State.SLEEPING else State.RUNNING,
                       Face.MACHINE) or ""


@dataclass(frozen=True)
class Machine:
    """A user's machine as the API shows it. Times are Unix seconds."""

    user_id: str
    sandbox_id: str
    state: str
    desired_state: str
    idle_timeout_s: float
    last_active_at: float
    created_at: float


class MachineManager:
    """Gets, creates, sleeps and wakes users' machines."""

    def __init__(self, sandboxes: SandboxManager, idle_timeout_s: float) -> None:
        self.sandboxes = sandboxes
        self.store = sandboxes.store
        self.idle_timeout_s = idle_timeout_s
        self._locks: dict[str, asyncio.Lock] = {}
        sandboxes.reconciler.add_pass("machines", self.reconcile)
        sandboxes.teams.count("machines", lambda team: sum(
            1 for m in self.store.list(MachineRecord) if owner_of(m.user_id) == team))

    @staticmethod
    def check_user(user_id: str) -> None:
        if not USER_ID.match(user_id):
            raise InvalidRequest("user id must be 1-128 characters of letters, digits, "
                                 "'.', '_', '@' or '-', starting with a letter or digit")

    def _view(self, m: MachineRecord, rec: SandboxRecord) -> Machine:
        return Machine(
            user_id=unscoped(m.user_id), sandbox_id=rec.id, state=NAMES[rec.state],
            desired_state=desired_name(rec.desired_state),
            idle_timeout_s=m.idle_timeout_s, last_active_at=rec.last_active_at,
            created_at=m.created_at)

    def _find(self, stored: str) -> tuple[MachineRecord, SandboxRecord] | None:
        """The machine stored under ``stored`` (a ``scoped`` user id) and its sandbox."""
        m = self.store.find(MachineRecord, stored)
        if m is None:
            return None
        rec = self.store.get(m.sandbox_id)
        if rec is None or rec.state in GONE:
            return None
        return m, rec

    def list(self) -> list[Machine]:
        """Every user's machine the acting team may see, oldest first."""
        out = []
        for m in sorted(self.store.list(MachineRecord), key=lambda m: m.created_at):
            if not name_visible(m.user_id):
                continue
            found = self._find(m.user_id)
            if found is not None:
                out.append(self._view(*found))
        return out

    def get(self, user_id: str) -> Machine:
        """The user's machine (of the acting team). Raises NotFound (also for another
        team's: it has none of that user)."""
        self.check_user(user_id)
        found = self._find(scoped(user_id))
        if found is None:
            raise NotFound(f"user {user_id} has no machine", user_id=user_id)
        return self._view(*found)

    async def get_or_create(self, user_id: str, idle_timeout_s: float | None = None,
                            opts: CreateOptions | None = None,
                            placement: Placement | None = None) -> tuple[Machine, bool]:
        """The user's machine, created (and booted) if there is none; (machine, created).
        ``placement``: the id a cluster claimed for a new one. A new one's sandbox is the
        acting team's (``SandboxManager.create``)."""
        self.check_user(user_id)
        stored = scoped(user_id)
        async with self._locks.setdefault(stored, asyncio.Lock()):
            found = self._find(stored)
            if found is not None:
                return self._view(*found), False
            idle = idle_timeout_s or self.idle_timeout_s
            base = opts or CreateOptions()
            rec = await self.sandboxes.create(dataclasses.replace(
                base, timeout_s=0, idle_timeout_s=idle,
                user_id=stored), placement)
            # No await from here to the record: the reconcile pass never sees
            # this sandbox without its machine record.
            self.store.remove(MachineRecord, stored)
            m = MachineRecord(user_id=stored, sandbox_id=rec.id, idle_timeout_s=idle,
                              created_at=time.time())
            self.store.add(m)
            return self._view(m, rec), True

    async def sleep(self, user_id: str, wait: bool = True) -> Machine:
        """Snapshot the machine and end its VM. Raises NotFound, Busy (a command runs).

        With ``wait=False`` only the desired state is set; the reconcile loop acts.
        """
        return await self._move(user_id, State.SLEEPING, wait)

    async def wake(self, user_id: str, wait: bool = True) -> Machine:
        """Restore a sleeping machine (a no-op when active). Raises NotFound, LimitExceeded.

        With ``wait=False`` only the desired state is set; the reconcile loop acts.
        """
        return await self._move(user_id, State.RUNNING, wait)

    async def _move(self, user_id: str, to: State, wait: bool) -> Machine:
        """Sleep (``to`` SLEEPING) or wake (RUNNING) the machine's sandbox, or with
        ``wait=False`` only set that desired state; returns the machine as it is then."""
        sid = self.get(user_id).sandbox_id
        if not wait:
            self.sandboxes.want(sid, to)
        elif to == State.SLEEPING:
            await self.sandboxes.sleep(sid)
        else:
            await self.sandboxes.wake(sid)
        return self.get(user_id)

    async def delete(self, user_id: str) -> None:
        """Remove the machine, its VM and its sleep snapshot."""
        m = self.get(user_id)
        await self.sandboxes.delete(m.sandbox_id)
        self.store.remove(MachineRecord, scoped(user_id))

    async def reconcile(self) -> None:
        """Keep machine records true to their sandboxes (see the module docstring). Runs
        with no team acting: it reads every team's machines by their stored names."""
        owned, gone, live = await asyncio.to_thread(self._read)
        # What was read may have moved since (a machine made or woken meanwhile): each
        # change below is decided again on a fresh read, here on the loop.
        for stored, sandbox_id in gone:
            now = self.store.find(MachineRecord, stored)
            if now is not None and now.sandbox_id == sandbox_id and not self._busy(stored):
                self.store.remove(MachineRecord, stored)
                log.info("machine record of a gone sandbox removed", extra={"user_id": stored})
        for rec in live:
            user = rec.user_id if isinstance(rec.user_id, str) else None
            if user is None or rec.id in owned or self._busy(user):
                continue
            fresh = self.store.get(rec.id)
            if fresh is None or fresh.state in GONE:
                continue
            found = self._find(user)
            if found is not None and found[0].sandbox_id == rec.id:
                continue
            if found is None:
                self.store.remove(MachineRecord, user)
                idle = rec.idle_timeout_s
                self.store.add(MachineRecord(user_id=user, sandbox_id=rec.id,
                                             idle_timeout_s=idle if isinstance(idle, float)
                                             and idle > 0 else self.idle_timeout_s,
                                             created_at=rec.created_at))
                log.info("machine record restored", extra={"user_id": user, "sandbox_id": rec.id})
            else:
                log.info("duplicate machine sandbox deleted", extra={"user_id": user,
                                                                      "sandbox_id": rec.id})
                try:
                    await self.sandboxes.delete(rec.id)
                except HangarError:
                    pass

    def _read(self) -> tuple[set[str], "builtins.list[tuple[str, str]]",
                             "builtins.list[SandboxRecord]"]:
        """What ``reconcile`` reads, in one go (it runs in a thread, off the event loop),
        in two queries however many machines there are: the sandbox ids that machine
        records name, (user, sandbox id) of those whose sandbox is gone, and the live
        sandboxes (past ``creating``) of a user that no machine record names."""
        states = self.store.machine_sandboxes()
        owned = {sid for sid, _ in states.values()}
        gone = [(user, sid) for user, (sid, state) in states.items()
                if state is None or state in GONE]
        live = self.store.unowned_user_sandboxes(LIVE - {State.CREATING})
        return owned, gone, live

    def _busy(self, user_id: str) -> bool:
        lock = self._locks.get(user_id)
        return lock is not None and lock.locked()
