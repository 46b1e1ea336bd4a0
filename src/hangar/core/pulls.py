"""Images of a registry, pulled for template builds (the ``pulls`` sub-surface).

A build ``FROM`` a registry's image (E2B's ``fromImage``) needs that image
as a Hangar image first: ``ImagePulls.image`` has it pulled and built by
``python -m hangar.images.pull`` as root, through the root helper's
``image_pull`` and ``image_pull_wait`` for a split server, as its own child
for a server that is root, and refuses otherwise. The image is named after
the reference (``hangar.images.registry.image_name``); a pull of an image
unchanged since its last reuses that build, so only the registry's inspect
and copy are paid again. One pull per image at a time here (a second build
of the same image waits for the first's, then pulls again: cheap when
unchanged). Credentials go to root and are kept nowhere.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass

from hangar.errors import ImageError, InvalidRequest
from hangar.images import registry
from hangar.images.pull import Pulls
from hangar.privileged import Client
from hangar.privileged.protocol import PullProgress

POLL_S = 1.0
"""Seconds between two looks at a running pull."""
PULL_DEADLINE_S = 3600.0
"""Longest a pull (copy, checks, unpack, pack) may take before the build fails; the
copy alone stops at ``registry.PULL_TIMEOUT_S``."""


@dataclass(frozen=True)
class Credentials:
    """A build's own registry credentials (E2B's ``fromImageRegistry``)."""

    username: str
    password: str

    def __repr__(self) -> str:  # never a password in a log or a traceback
        return f"Credentials(username={self.username!r}, password=<hidden>)"


class ImagePulls:
    """``m.pulls``: a registry's images as Hangar images, for builds."""

    def __init__(self, settings: object, data: os.PathLike[str] | str,
                 helper: Client | None) -> None:
        self._settings = settings
        self._data = data
        self._helper = helper
        self._own: Pulls | None = None
        self._locks: dict[str, asyncio.Lock] = {}

    def check(self, ref: str) -> str:
        """The Hangar image name a pull of ``ref`` makes; raises InvalidRequest for a
        reference that does not parse or whose registry the operator's policy
        (``HANGAR_REGISTRIES``) does not allow."""
        parsed = registry.parse(ref)
        registry.Policy.from_settings(self._settings).check(parsed)
        return registry.image_name(parsed)

    async def image(self, ref: str, creds: Credentials | None,
                    say: Callable[[str], None]) -> str:
        """Pull ``ref`` and build it as a Hangar image; returns the image's name. Says
        each line of the pull's progress. Raises InvalidRequest (``check``) and
        ImageError naming the registry (unreachable, no such image or tag, refused
        credentials, a layer Hangar refuses, a pull past ``PULL_DEADLINE_S``)."""
        name = self.check(ref)
        lock = self._locks.setdefault(name, asyncio.Lock())
        async with lock:
            start, poll = self._runner()
            await asyncio.to_thread(start, name, ref, creds.username if creds else None,
                                    creds.password if creds else None)
            offset, last = 0, ""
            loop = asyncio.get_running_loop()
            deadline = loop.time() + PULL_DEADLINE_S
            while True:
                got: PullProgress = await asyncio.to_thread(poll, name, offset)
                offset = got["offset"]
                for line in got["lines"]:
                    last = line or last
                    if not line.startswith(("ERROR: ", "IMAGE ")):
                        say(line)
                if got["exit"] is not None:
                    break
                if loop.time() > deadline:
                    raise ImageError(f"pulling {ref} took over {PULL_DEADLINE_S:.0f} s")
                await asyncio.sleep(POLL_S)
        if got["exit"] != 0:
            why = last.removeprefix("ERROR: ") if last.startswith("ERROR: ") else \
                f"the puller ended with status {got['exit']}"
            raise ImageError(why, image=ref)
        return name

    def _runner(self) -> tuple[Callable[..., None], Callable[[str, int], PullProgress]]:
        """(start, poll) of the helper's pulls, or of this process's own when it is root."""
        if self._helper is not None:
            return self._helper.image_pull, self._helper.image_pull_wait
        if os.geteuid() != 0:
            raise InvalidRequest("this server cannot pull images from a registry: it runs "
                                 "neither as root nor beside the root helper "
                                 "(start hangar serve as root)")
        if self._own is None:
            self._own = Pulls(self._data)  # type: ignore[arg-type]
        return self._own.start, self._own.poll

    async def close(self) -> None:
        """End the pulls this process runs itself (the helper ends its own)."""
        if self._own is not None:
            self._own.stop_all()
