"""Admission: what a create asks for, and the caps a server keeps.

Every state that may hold a VMM (``lifecycle.VMM_STATES``, pooled VMs
included) counts against ``max_sandboxes`` and, by its guest memory,
against the memory budget (``memory_budget_mib``, default 80 % of the
host's RAM). ``Admission.slot`` checks both and lets the caller write its
record (a new one, or a move to ``waking`` or ``restoring``) under one
lock, so a storm of creates cannot overshoot them: the check and the write
happen with no await between other admissions. Both refusals are 429
``LimitExceeded`` with ``Retry-After`` and the reason.

Also here: the disk a create may ask for (``max_disk_mib``, 400 beyond;
the guest's disk is a qcow2 overlay of that virtual size, so a guest that
fills it gets ENOSPC and the host file stays bounded), the room left for
snapshots (``snapshot_storage_bytes``, 429 beyond: ``check_snapshot_room``)
and commands running at once in one sandbox (``ExecSlots``, 429 beyond).

Before its admission a start (a boot, restore or wake) takes its turn at the
start gate (``Admission.starts``, ``hangar.core.starts``): at most
``max_concurrent_starts`` run at once, the rest wait in a bounded FIFO queue.
A create that the caps refuse anyway is refused before it queues
(``Admission.check``); one that finds the VMM cap reached does not wait for
room: sandboxes live for minutes or hours, so room comes back at a client's
delete, not within a request's time, and the 429 says when to try again.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hangar.config import Settings
from hangar.core.context import Context
from hangar.core.lifecycle import OnExpiry, State
from hangar.core.memory import RELIEF_TRIES, START_COST_MIB, meminfo
from hangar.core.starts import StartGate, default_concurrent_starts
from hangar.core.store import SandboxRecord
from hangar.errors import InvalidRequest, LimitExceeded
from hangar.images import RECIPES, GuestImage

if TYPE_CHECKING:
    from hangar.core.memory import Memory
    from hangar.core.teams import Teams

RETRY_AFTER_S = 5.0
"""What a refused create is told to wait, seconds."""
EXEC_RETRY_AFTER_S = 1.0
"""What a command refused by the per-sandbox cap is told to wait, seconds."""
SNAPSHOT_RETRY_AFTER_S = 60.0
"""What a snapshot refused for lack of room is told to wait, seconds (room comes back
only when snapshots are deleted)."""
MEMORY_BUDGET_SHARE = 0.8
"""Share of the host's RAM that guests may hold when no budget is set."""
SNAPSHOT_SHARE = 0.5
"""Share of the data directory's file system that snapshots may hold when no cap is set."""


def allocated_bytes(path: os.PathLike[str] | str) -> int:
    """Bytes a file takes on disk (its allocated blocks); 0 when it is missing."""
    try:
        return os.stat(path).st_blocks * 512
    except OSError:
        return 0

@dataclass(frozen=True)
class CreateOptions:
    """What a create asks for; ``None`` takes the server's default.

    Sizes in MiB; ``timeout_s`` is the time to live in seconds (0: none);
    ``idle_timeout_s`` makes the sandbox sleep after that many idle seconds.
    ``metadata`` is the client's, stored as given and never read as state;
    what the server itself keeps goes in the fields after it (``user_id``: the
    machine's user, ``e2b``: E2B's options), each in a column of its own.
    """

    image: str | None = None
    vcpus: int | None = None
    memory_mib: int | None = None
    disk_mib: int | None = None
    timeout_s: float | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    desktop: str | None = None
    """Screen as ``WIDTHxHEIGHTxDEPTH`` (pixels, bits); starts the guest's desktop."""
    idle_timeout_s: float | None = None
    network: Any = None
    """Egress policy: ``none``, ``internet``, ``open`` or a dict with ``egress``,
    ``allow`` and ``deny`` CIDR lists; None takes the server's default."""
    user_id: str | None = None
    """The user whose machine it is (``hangar.core.machines``), or None."""
    e2b: dict[str, Any] | None = None
    """E2B's options of a create through ``/e2b`` (``hangar.core.e2b.Options.as_dict``)."""
    on_expiry: OnExpiry = OnExpiry.DELETE
    """What the end of its time to live does (``lifecycle.OnExpiry``)."""
    auto_resume: bool = False
    """Whether a call wakes it once it sleeps, as asked (Hangar always wakes it)."""
    sleep_memory: bool | None = None
    """False: a sleep at expiry keeps its disk alone and the wake boots it cold (the
    record's ``sleep_memory``); None: memory too."""
    volumes: dict[str, Any] | None = None
    """Named volumes by guest path (``hangar.core.volumes.parse_request``), or None."""
    secrets: dict[str, str] | None = None
    """Vault secrets by environment variable (``hangar.core.secrets``), or None."""
    team: str | None = None
    """The team it is made for (``hangar.core.teams``: the verbs set it from the acting
    team), or None: the operator's."""


def new_id(prefix: str = "sb-") -> str:
    """A new random id: ``prefix`` and 12 hex digits."""
    return prefix + secrets.token_hex(6)


def check_desktop(screen: str, image: GuestImage) -> None:
    """Refuse at create a desktop that could never start or be shot: a bad size, one of
    more than ``DESKTOP_MAX_PIXELS`` pixels, or an image without X.

    Raises InvalidRequest naming the problem.
    """
    from hangar.guest.desktop import parse_geometry
    from hangar.images import RECIPES
    from hangar.schemas.bounds import check_desktop_size

    try:
        parse_geometry(screen)
        check_desktop_size(screen)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    recipe = RECIPES.get(image.name)
    if (recipe is not None and "xvfb" not in recipe.packages) or (
            image.template is not None and not image.template.get("desktop")):
        raise InvalidRequest(f"image {image.name!r} has no desktop; use an image with one, "
                             "such as 'desktop'", image=image.name)


DEFAULT_SCREEN = "1024x768x24"
"""The desktop a client most often asks for (the agent tools' default, the docs'
examples): an image with a desktop gets a template snapshot of it at build."""


def has_desktop(image: GuestImage) -> bool:
    """Whether ``image`` is known to run a desktop: its recipe installs Xvfb, or its
    template (``hangar template build``) says ``desktop``."""
    from hangar.images import RECIPES

    recipe = RECIPES.get(image.name)
    if recipe is not None:
        return "xvfb" in recipe.packages
    return image.template is not None and bool(image.template.get("desktop"))


def default_size(image: GuestImage, settings: Settings) -> tuple[int, int]:
    """(vCPUs, memory in MiB) of a sandbox of ``image`` whose create names none: the
    image's recipe's (``Recipe.default_vcpus``/``default_memory_mib``; desktop and dev
    need 2048 MiB) or template's (its file's, else its base's), else the server's settings."""
    recipe = RECIPES.get(image.name)
    template = image.template or {}
    return ((recipe and recipe.default_vcpus) or template.get("vcpus")
            or settings.default_vcpus,
            (recipe and recipe.default_memory_mib) or template.get("memory_mib")
            or settings.default_memory_mib)


class Admission:
    """The cap on concurrent VMMs, and the shape of new records."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._lock = asyncio.Lock()
        self.teams: Teams | None = None
        """Team quotas (``hangar.core.teams``), set by the manager."""
        self.memory: Memory | None = None
        """The host's headroom and its relief (``hangar.core.memory``), set by the manager."""
        s = ctx.settings
        self.starts = StartGate(s.max_concurrent_starts or default_concurrent_starts(),
                                s.start_queue, s.start_queue_wait_s, ctx.metrics)
        """Starts in progress at once and the queue before them (``hangar.core.starts``):
        a start takes its turn there before ``slot``."""

    def room(self) -> int:
        """How many more VMMs may start now."""
        return self.ctx.settings.max_sandboxes - len(self.ctx.store.with_vmm())

    def memory_budget_mib(self) -> int:
        """Guest memory all VMMs may hold together, MiB (``memory_budget_mib``, else
        ``MEMORY_BUDGET_SHARE`` of the host's RAM)."""
        s = self.ctx.settings
        return s.memory_budget_mib or int(meminfo("MemTotal") * MEMORY_BUDGET_SHARE)

    def memory_used_mib(self) -> int:
        """Guest memory of every record that may hold a VMM (pooled ones too), MiB."""
        return sum(r.memory_mib for r in self.ctx.store.with_vmm())

    def _refusal(self, memory_mib: int | None, rec: SandboxRecord | None = None
                 ) -> LimitExceeded | None:
        if rec is not None and rec.team is not None and self.teams is not None:
            refused = self.teams.refusal(rec)
            if refused is not None:
                return refused
        if self.room() <= 0:
            cap = self.ctx.settings.max_sandboxes
            return LimitExceeded(f"at most {cap} sandboxes may run at once",
                                 retry_after=RETRY_AFTER_S, limit=cap)
        if memory_mib:
            budget, used = self.memory_budget_mib(), self.memory_used_mib()
            ratio = self.ctx.settings.memory_overcommit
            allowed = int(budget * ratio)
            if used + memory_mib > allowed:
                over = "" if ratio == 1 else (
                    f" × {ratio:g} (HANGAR_MEMORY_OVERCOMMIT) = {allowed} MiB")
                return LimitExceeded(
                    f"the host memory budget is {budget} MiB (HANGAR_MEMORY_BUDGET_MIB){over} "
                    f"and running sandboxes hold {used} MiB; this one needs {memory_mib} MiB",
                    retry_after=RETRY_AFTER_S, limit="memory_budget_mib", budget_mib=budget,
                    overcommit=ratio, used_mib=used, needed_mib=memory_mib)
        return None

    def check(self, memory_mib: int | None, rec: SandboxRecord | None = None,
              create: bool = True) -> None:
        """Raise at once the refusal ``slot`` would give by the caps (the VMM cap, the
        memory budget, ``rec``'s team's quotas), so a start that could not be admitted
        does not wait in the start queue first. ``slot`` checks again after the wait.

        Raises LimitExceeded (or QuotaExceeded) as ``slot`` does.
        """
        refusal = self._refusal(memory_mib, rec)
        if refusal is not None:
            if create:
                self.ctx.metrics.creates.labels("limited").inc()
            raise refusal

    @asynccontextmanager
    async def turn(self, kind: str, memory_mib: int | None, rec: SandboxRecord | None = None,
                   create: bool = True) -> AsyncIterator[None]:
        """A start's way in: refused at once by the caps (``check``), else its turn at the
        start gate (``starts.turn``), held while the block runs; ``slot`` inside it admits
        the VMM. Raises LimitExceeded (or QuotaExceeded) as ``check`` and ``starts.turn``
        do."""
        self.check(memory_mib, rec, create)
        async with self.starts.turn(kind):
            yield

    def _pressure(self, memory_mib: int | None) -> LimitExceeded | None:
        """The refusal of one more VMM by the host's headroom (``hangar.core.memory``)."""
        if not memory_mib or self.memory is None:
            return None
        return self.memory.low(min(START_COST_MIB, memory_mib))

    @asynccontextmanager
    async def slot(self, create: bool = True, memory_mib: int | None = None,
                   rec: SandboxRecord | None = None) -> AsyncIterator[None]:
        """Hold admission while writing the record of one more VMM of ``memory_mib`` MiB
        (``rec``'s, whose team's quotas are checked too: ``hangar.core.teams``).

        Raises LimitExceeded (retryable after ``RETRY_AFTER_S``) when the cap on
        VMMs is reached, the memory budget (× its overcommit) has no room for
        ``memory_mib``, the record's team would pass a limit, or the host's available
        memory would fall below its headroom once idle sandboxes were put to sleep
        (``hangar.core.memory``: up to ``RELIEF_TRIES`` of them, outside the lock); a
        refused ``create`` is counted as such in the metrics. The caller must write its
        record before leaving the block.
        """
        for attempt in range(RELIEF_TRIES + 1):
            async with self._lock:
                refusal = self._refusal(memory_mib, rec)
                low = None if refusal is not None else self._pressure(memory_mib)
                if refusal is None and low is None:
                    yield
                    return
            if low is not None and attempt < RELIEF_TRIES and self.memory is not None \
                    and await self.memory.relieve():
                continue
            if create:
                self.ctx.metrics.creates.labels("limited").inc()
            raise refusal or low  # type: ignore[misc]

    @asynccontextmanager
    async def if_room(self, memory_mib: int | None = None) -> AsyncIterator[bool]:
        """Like ``slot`` but yields False instead of raising, and never puts a sandbox
        to sleep (for the warm pool: it does not refill under memory pressure)."""
        async with self._lock:
            yield self._refusal(memory_mib) is None and self._pressure(memory_mib) is None

    def check_disk(self, disk_mib: int | None) -> None:
        """Refuse a disk over ``max_disk_mib`` (InvalidRequest naming the limit)."""
        cap = self.ctx.settings.max_disk_mib
        if disk_mib is not None and disk_mib > cap:
            raise InvalidRequest(f"disk_mib {disk_mib} is over this server's limit of {cap} MiB "
                                 "(HANGAR_MAX_DISK_MIB)", field="disk_mib", limit=cap)

    def snapshot_cap_bytes(self) -> int:
        """Bytes all snapshots may hold (``snapshot_storage_bytes``, else
        ``SNAPSHOT_SHARE`` of the data directory's file system)."""
        s = self.ctx.settings
        if s.snapshot_storage_bytes is not None:
            return s.snapshot_storage_bytes
        try:
            st = os.statvfs(self.ctx.layout.snapshots)
        except OSError:
            st = os.statvfs(self.ctx.layout.root)
        return int(st.f_blocks * st.f_frsize * SNAPSHOT_SHARE)

    def check_snapshot_room(self, rec: SandboxRecord) -> None:
        """Refuse a user snapshot of ``rec`` that could take snapshots past their cap.

        Snapshots already held (user and sleep ones, by their recorded size)
        plus this one's upper bound (its guest memory plus the allocated size
        of its disk) must fit in ``snapshot_cap_bytes``. Raises LimitExceeded
        (429) naming the cap. Sleep snapshots are counted but never refused:
        a machine that cannot sleep would keep its memory instead.
        """
        from hangar.core.store import SnapshotRecord

        cap = self.snapshot_cap_bytes()
        used = sum(s.size_bytes for s in self.ctx.store.list(SnapshotRecord))
        need = (rec.memory_mib << 20) + allocated_bytes(self.ctx.layout.sandbox(rec.id).disk)
        if used + need > cap:
            raise LimitExceeded(
                f"snapshot storage is capped at {cap} bytes (HANGAR_SNAPSHOT_STORAGE_BYTES); "
                f"snapshots hold {used} bytes and this one may take up to {need}; delete "
                "snapshots to make room", retry_after=SNAPSHOT_RETRY_AFTER_S,
                limit="snapshot_storage_bytes", cap_bytes=cap, used_bytes=used,
                needed_bytes=need)

    def new_record(self, sid: str, state: State, image: GuestImage, opts: CreateOptions,
                   network: dict[str, Any] | None, vcpus: int | None = None,
                   memory_mib: int | None = None, disk_mib: int | None = None) -> SandboxRecord:
        """A record for a new sandbox; ``network`` is the policy as stored (None: no NIC).

        A size the create leaves out comes from the image's recipe
        (``Recipe.default_vcpus``/``default_memory_mib``), else the server's settings."""
        s = self.ctx.settings
        self.check_disk(opts.disk_mib)
        now = time.time()
        ttl = opts.timeout_s if opts.timeout_s is not None else s.default_timeout_s
        default_vcpus, default_memory = default_size(image, s)
        metadata = {k: v for k, v in opts.metadata.items()
                    if isinstance(k, str) and isinstance(v, str)}
        return SandboxRecord(
            id=sid, state=state, desired_state=State.RUNNING,
            image=image.name, image_digest=image.digest, engine=self.ctx.engine.name,
            accel=self.ctx.engine.accel, vcpus=vcpus or opts.vcpus or default_vcpus,
            memory_mib=memory_mib or opts.memory_mib or default_memory,
            disk_mib=disk_mib or opts.disk_mib or s.default_disk_mib, pid=None, created_at=now,
            updated_at=now, last_active_at=now, expires_at=now + ttl if ttl else None,
            metadata_=metadata, desktop=opts.desktop, network=network,
            user_id=opts.user_id, idle_timeout_s=opts.idle_timeout_s or None,
            e2b=dict(opts.e2b) if opts.e2b is not None else None, pooled=False,
            team=opts.team,
            on_expiry=opts.on_expiry, auto_resume=opts.auto_resume, ttl_s=ttl or None,
            sleep_memory=opts.sleep_memory,
        )


class ExecSlots:
    """The cap on commands running at once in one sandbox (``max_execs_per_sandbox``)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._running: dict[str, int] = {}

    def running(self, sandbox_id: str) -> int:
        return self._running.get(sandbox_id, 0)

    @contextmanager
    def take(self, sandbox_id: str) -> Iterator[None]:
        """Count one more command in ``sandbox_id`` while the block runs.

        Raises LimitExceeded (429, ``Retry-After`` ``EXEC_RETRY_AFTER_S``) when
        ``limit`` already run there.
        """
        n = self._running.get(sandbox_id, 0)
        if n >= self.limit:
            raise LimitExceeded(
                f"at most {self.limit} commands may run at once in sandbox {sandbox_id} "
                "(HANGAR_MAX_EXECS_PER_SANDBOX); retry when one has finished",
                retry_after=EXEC_RETRY_AFTER_S, limit=self.limit, sandbox_id=sandbox_id)
        self._running[sandbox_id] = n + 1
        try:
            yield
        finally:
            left = self._running.get(sandbox_id, 1) - 1
            if left > 0:
                self._running[sandbox_id] = left
            else:
                self._running.pop(sandbox_id, None)
