"""Admission: what a create asks for, and the cap on concurrent VMMs.

Every state that may hold a VMM (``lifecycle.VMM_STATES``, pooled VMs
included) counts against ``max_sandboxes``. ``Admission.slot`` checks the
count and lets the caller write its record (a new one, or a move to
``waking`` or ``restoring``) under one lock, so a storm of creates cannot
overshoot the cap: the check and the write happen with no await between
other admissions.
"""

from __future__ import annotations

import asyncio
import secrets
from contextvars import ContextVar
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from hangar.config import Settings
from hangar.core.context import Context
from hangar.core.lifecycle import State
from hangar.core.store import SandboxRecord
from hangar.errors import InvalidRequest, LimitExceeded
from hangar.images import RECIPES, GuestImage

RETRY_AFTER_S = 5.0
"""What a refused create is told to wait, seconds."""

placed_id: ContextVar[str | None] = ContextVar("placed_id", default=None)
"""The id a cluster placed (and claimed) the current request's new sandbox under, if any:
set by ``hangar.cluster.gateway`` around one request, read by the create that request makes."""


@dataclass(frozen=True)
class CreateOptions:
    """What a create asks for; ``None`` takes the server's default.

    Sizes in MiB; ``timeout_s`` is the time to live in seconds (0: none);
    ``idle_timeout_s`` makes the sandbox sleep after that many idle seconds.
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
    sandbox_id: str | None = None
    """The new sandbox's id when it was chosen (and claimed) before the create: a
    cluster places a create and claims its id, then the owner node makes it."""


def new_id(prefix: str = "sb-") -> str:
    """A new random id: ``prefix`` and 12 hex digits."""
    return prefix + secrets.token_hex(6)


def check_desktop(screen: str, image: GuestImage) -> None:
    """Refuse at create a desktop that could never start: a bad size, or an image without X.

    Raises InvalidRequest naming the problem.
    """
    from hangar.guest.desktop import parse_geometry
    from hangar.images import RECIPES

    try:
        parse_geometry(screen)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    recipe = RECIPES.get(image.name)
    if (recipe is not None and "xvfb" not in recipe.packages) or (
            image.template is not None and not image.template.get("desktop")):
        raise InvalidRequest(f"image {image.name!r} has no desktop; use an image with one, "
                             "such as 'desktop'", image=image.name)


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

    def room(self) -> int:
        """How many more VMMs may start now."""
        return self.ctx.settings.max_sandboxes - len(self.ctx.store.with_vmm())

    @asynccontextmanager
    async def slot(self, create: bool = True) -> AsyncIterator[None]:
        """Hold admission while writing the record of one more VMM.

        Raises LimitExceeded (retryable after ``RETRY_AFTER_S``) when the cap
        is reached; a refused ``create`` is counted as such in the metrics. The
        caller must write its record before leaving the block.
        """
        async with self._lock:
            if self.room() <= 0:
                cap = self.ctx.settings.max_sandboxes
                if create:
                    self.ctx.metrics.creates.labels("limited").inc()
                raise LimitExceeded(f"at most {cap} sandboxes may run at once",
                                    retry_after=RETRY_AFTER_S, limit=cap)
            yield

    @asynccontextmanager
    async def if_room(self) -> AsyncIterator[bool]:
        """Like ``slot`` but yields False instead of raising (for the warm pool)."""
        async with self._lock:
            yield self.room() > 0

    def new_record(self, sid: str, state: State, image: GuestImage, opts: CreateOptions,
                   network: dict[str, Any] | None, vcpus: int | None = None,
                   memory_mib: int | None = None, disk_mib: int | None = None) -> SandboxRecord:
        """A record for a new sandbox; ``network`` is the policy as stored (None: no NIC).

        A size the create leaves out comes from the image's recipe
        (``Recipe.default_vcpus``/``default_memory_mib``), else the server's settings."""
        s = self.ctx.settings
        now = time.time()
        ttl = opts.timeout_s if opts.timeout_s is not None else s.default_timeout_s
        default_vcpus, default_memory = default_size(image, s)
        metadata: dict[str, Any] = dict(opts.metadata)
        if opts.idle_timeout_s:
            metadata["idle_timeout_s"] = opts.idle_timeout_s
        return SandboxRecord(
            id=sid, state=state, desired_state=State.RUNNING,
            image=image.name, image_digest=image.digest, engine=self.ctx.engine.name,
            accel=self.ctx.engine.accel, vcpus=vcpus or opts.vcpus or default_vcpus,
            memory_mib=memory_mib or opts.memory_mib or default_memory,
            disk_mib=disk_mib or opts.disk_mib or s.default_disk_mib, pid=None, created_at=now,
            updated_at=now, last_active_at=now, expires_at=now + ttl if ttl else None,
            metadata_=metadata, desktop=opts.desktop, network=network,
        )
