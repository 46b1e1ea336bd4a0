"""Test-only hooks: kill the server at a named step, hold a wake up.

Never set these in production. They let tests prove that a server killed
at any step of a lifecycle operation comes back consistent
(``hangar.core.recovery``), and that one slow operation never delays the
reconcile loop's work on other sandboxes.

``HANGAR_TEST_CRASH_AT=<step>``
    The server SIGKILLs itself (no clean-up of any kind, as a power cut or
    the OOM killer would) when it reaches ``<step>``, one of ``CRASH_STEPS``.
``HANGAR_TEST_WAKE_DELAY_S=<seconds>``
    Every wake waits that long after the sandbox has moved to ``waking``,
    before its VM is restored (holding the sandbox's lock, as a slow
    restore would).

The variables are read at each call, so a test sets them per server process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

log = logging.getLogger("hangar.testhooks")

CRASH_STEPS: dict[str, str] = {
    "create.booting": "a create's VMM runs; its agent has not answered",
    "create.restoring": "a create's VMM restored its template snapshot; its agent has "
                        "not answered, the guest is not re-identified",
    "snapshot.paused": "a snapshot has paused the VM; nothing is saved yet",
    "snapshot.saved": "a snapshot's files are complete, not yet recorded; the VM is paused",
    "sleep.paused": "a sleep has paused the VM; nothing is saved yet",
    "sleep.saved": "the sleep snapshot is recorded; the VM is paused",
    "sleep.stopped": "the sleep snapshot is recorded and the VMM ended; still snapshotting",
    "wake.restored": "a wake's VM is restored and refreshed; still waking",
    "restore.stopped": "a restore has ended the old VM; the new one is not started",
    "restore.restored": "a restore's new VM runs and is refreshed; still restoring",
    "fork.restored": "a fork's VM runs and is refreshed; still creating",
    "delete.stopping": "a delete has moved the sandbox to stopping; its VMM still runs",
}
"""The named steps, and what is true on disk when the server dies there."""


def crash_point(step: str) -> None:
    """SIGKILL this process if ``HANGAR_TEST_CRASH_AT`` names ``step``."""
    if step not in CRASH_STEPS:
        raise ValueError(f"unknown crash step {step!r}")
    if os.environ.get("HANGAR_TEST_CRASH_AT") == step:
        log.warning("test hook: killing the server", extra={"step": step})
        os.kill(os.getpid(), signal.SIGKILL)


async def wake_delay() -> None:
    """Sleep ``HANGAR_TEST_WAKE_DELAY_S`` seconds (default 0)."""
    try:
        delay = float(os.environ.get("HANGAR_TEST_WAKE_DELAY_S", "0") or 0)
    except ValueError:
        delay = 0.0
    if delay > 0:
        log.warning("test hook: holding a wake up", extra={"delay_s": delay})
        await asyncio.sleep(delay)
