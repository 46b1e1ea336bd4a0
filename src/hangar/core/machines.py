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
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass

from hangar.core.sandboxes import CreateOptions, SandboxManager
from hangar.core.states import GONE, State
from hangar.core.store import MachineRecord, SandboxRecord
from hangar.errors import InvalidRequest, NotFound

USER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$")

NAMES = {
    State.CREATING.value: "creating",
    State.RUNNING.value: "active",
    State.SNAPSHOTTING.value: "snapshotting",
    State.SLEEPING.value: "sleeping",
    State.WAKING.value: "waking",
    State.FAILED.value: "failed",
    State.STOPPING.value: "stopping",
}


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

    @staticmethod
    def check_user(user_id: str) -> None:
        if not USER_ID.match(user_id):
            raise InvalidRequest("user id must be 1-128 characters of letters, digits, "
                                 "'.', '_', '@' or '-', starting with a letter or digit")

    def _view(self, m: MachineRecord, rec: SandboxRecord) -> Machine:
        return Machine(
            user_id=m.user_id, sandbox_id=rec.id, state=NAMES.get(rec.state, rec.state),
            desired_state="sleeping" if rec.desired_state == State.SLEEPING.value else "active",
            idle_timeout_s=m.idle_timeout_s, last_active_at=rec.last_active_at,
            created_at=m.created_at)

    def _find(self, user_id: str) -> tuple[MachineRecord, SandboxRecord] | None:
        m = self.store.find(MachineRecord, user_id)
        if m is None:
            return None
        rec = self.store.get(m.sandbox_id)
        if rec is None or rec.state in {s.value for s in GONE}:
            return None
        return m, rec

    def list(self) -> list[Machine]:
        """Every user's machine, oldest first."""
        out = []
        for m in sorted(self.store.list(MachineRecord), key=lambda m: m.created_at):
            found = self._find(m.user_id)
            if found is not None:
                out.append(self._view(*found))
        return out

    def get(self, user_id: str) -> Machine:
        """The user's machine. Raises NotFound."""
        self.check_user(user_id)
        found = self._find(user_id)
        if found is None:
            raise NotFound(f"user {user_id} has no machine", user_id=user_id)
        return self._view(*found)

    async def get_or_create(self, user_id: str, idle_timeout_s: float | None = None,
                            opts: CreateOptions | None = None) -> tuple[Machine, bool]:
        """The user's machine, created (and booted) if there is none; (machine, created)."""
        self.check_user(user_id)
        async with self._locks.setdefault(user_id, asyncio.Lock()):
            found = self._find(user_id)
            if found is not None:
                return self._view(*found), False
            idle = idle_timeout_s or self.idle_timeout_s
            base = opts or CreateOptions()
            rec = await self.sandboxes.create(CreateOptions(
                image=base.image, vcpus=base.vcpus, memory_mib=base.memory_mib,
                disk_mib=base.disk_mib, timeout_s=0, idle_timeout_s=idle,
                metadata={**base.metadata, "user_id": user_id}, desktop=base.desktop))
            self.store.remove(MachineRecord, user_id)
            m = MachineRecord(user_id=user_id, sandbox_id=rec.id, idle_timeout_s=idle,
                              created_at=time.time())
            self.store.add(m)
            return self._view(m, rec), True

    async def sleep(self, user_id: str) -> Machine:
        """Snapshot the machine and end its VM. Raises NotFound, Busy (a command runs)."""
        m = self.get(user_id)
        await self.sandboxes.sleep(m.sandbox_id)
        return self.get(user_id)

    async def wake(self, user_id: str) -> Machine:
        """Restore a sleeping machine (a no-op when active). Raises NotFound, LimitExceeded."""
        m = self.get(user_id)
        await self.sandboxes.wake(m.sandbox_id)
        return self.get(user_id)

    async def delete(self, user_id: str) -> None:
        """Remove the machine, its VM and its sleep snapshot."""
        m = self.get(user_id)
        await self.sandboxes.delete(m.sandbox_id)
        self.store.remove(MachineRecord, user_id)
