"""A template's start command and ready check, run when one of its sandboxes boots.

Right after the agent of a freshly booted sandbox answers (a cold create,
or a warm-pool boot before the VM is paused, so a pooled VM is handed out
ready), and before the create answers:

1. the start command runs in the background: ``/bin/sh -c`` in the
   template's ``workdir``, with the template's environment (the agent adds
   it to every command), its output appended to ``/run/hangar/start.log``,
   detached from the agent's call (it outlives it, like a service);
2. the ready check is repeated every ``interval_s`` until it passes: ``port``
   passes when a TCP connection to it in the guest opens (through the
   agent's tunnel, so the image needs no tools), ``command`` when it exits 0.

When the start command exits with a non-zero status before the check
passes, the create fails at once with ``GuestError`` (502, not retryable:
the template is broken, a retry would fail the same way) quoting the start
log's tail. When the check does not pass within ``timeout_s`` the create fails with
``Timeout`` (504) naming the check and quoting the start log's tail, and,
like any failed create, leaves nothing behind. Sandboxes made from
snapshots (a template snapshot, restore, fork, a machine's wake) carry their
processes in the snapshot and run neither step: a template's snapshot is made
after both passed (``hangar.core.templates``).
"""

from __future__ import annotations

import asyncio
import logging
import shlex
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from hangar.engines.agent_client import AgentClient, exec_meta
from hangar.errors import GuestError, HangarError, Timeout
from hangar.guest import paths

log = logging.getLogger("hangar.startup")

START_LOG = paths.START_LOG
"""Where the start command's output goes in the guest."""
START_EXIT = paths.RUN_DIR + "/start.exit"
"""Where the start command's exit status goes in the guest when it ends."""
CHECK_TIMEOUT_S = 10.0
"""Longest one run of a ready ``command`` may take, seconds."""

Step = Callable[[AgentClient, Any], Awaitable[None]]


def start_script(start: str, workdir: str | None) -> str:
    """The shell script that starts ``start`` in the background and returns at once; when
    the command ends, its exit status goes to ``START_EXIT``."""
    cd = f"cd {shlex.quote(workdir)} || exit 1; " if workdir else ""
    return (f"rm -f {START_EXIT}; {cd}exec >>{START_LOG} 2>&1 </dev/null; "
            f"echo \"hangar: starting: $0\"; "
            f"( ( /bin/sh -c \"$0\"; echo $? >{START_EXIT}.part; "
            f"mv {START_EXIT}.part {START_EXIT} ) & )")


async def _exited(agent: AgentClient) -> int | None:
    """The start command's exit status when it has ended, else None."""
    r = await agent.exec(exec_meta(argv=["cat", START_EXIT], timeout=10))
    if r.exit_code != 0:
        return None
    try:
        return int(r.stdout.head.decode().strip())
    except ValueError:
        return None


async def _log_tail(agent: AgentClient) -> str:
    try:
        r = await agent.exec(exec_meta(argv=["tail", "-c", "2000", START_LOG], timeout=10))
        return r.stdout.head.decode("utf-8", "replace").strip()
    except HangarError:
        return ""


async def _passes(agent: AgentClient, ready: Mapping[str, Any], left: float) -> tuple[bool, str]:
    """One run of the ready check: (passed, what was seen)."""
    if ready.get("port"):
        try:
            tunnel = await agent.open_tunnel(int(ready["port"]))
        except HangarError as exc:
            return False, exc.message
        await tunnel.close()
        return True, ""
    r = await agent.exec(exec_meta(argv=["/bin/sh", "-c", str(ready["command"])],
                                   timeout=max(1.0, min(CHECK_TIMEOUT_S, left))))
    seen = (r.stdout.head + r.stderr.head).decode("utf-8", "replace").strip()[-300:]
    return r.exit_code == 0, f"exit {r.exit_code}" + (f": {seen}" if seen else "")


async def run_template(agent: AgentClient, template: Mapping[str, Any], *, name: str,
                       sandbox_id: str) -> None:
    """Start the template's command and wait for its ready check (see the module docstring).

    Raises GuestError when the start command cannot be started or exits
    non-zero before the check passes, Timeout when the check does not pass in time.
    """
    start, ready = template.get("start"), template.get("ready")
    t0 = time.monotonic()
    if start:
        r = await agent.exec(exec_meta(argv=["/bin/sh", "-c",
                                             start_script(start, template.get("workdir")),
                                             str(start)], timeout=30))
        if r.exit_code != 0:
            raise GuestError(f"template {name}: its start command could not be started "
                             f"(exit {r.exit_code}): "
                             f"{(r.stdout.head + r.stderr.head).decode('utf-8', 'replace')[-300:]}",
                             sandbox_id=sandbox_id, image=name)
    if not ready:
        return
    loop = asyncio.get_running_loop()
    timeout = float(ready.get("timeout_s") or 60.0)
    interval = float(ready.get("interval_s") or 0.5)
    deadline = loop.time() + timeout
    what = f"port {ready['port']} accepts" if ready.get("port") else f"`{ready.get('command')}`"
    seen = ""
    while True:
        ok, seen = await _passes(agent, ready, deadline - loop.time())
        if ok:
            log.info("template ready", extra={"sandbox_id": sandbox_id, "image": name,
                                              "duration_s": round(time.monotonic() - t0, 3)})
            return
        if start:
            code = await _exited(agent)
            if code is not None and code != 0:
                tail = await _log_tail(agent)
                raise GuestError(
                    f"template {name}: its start command exited with status {code} before "
                    f"the ready check ({what}) passed; the start command's log ({START_LOG}) "
                    f"ends with:\n{tail}", sandbox_id=sandbox_id, image=name, exit_code=code)
        if loop.time() + interval >= deadline:
            break
        await asyncio.sleep(interval)
    tail = await _log_tail(agent) if start else ""
    raise Timeout(f"template {name}: not ready within {timeout:g} s: the ready check ({what}) "
                  f"did not pass (last: {seen or 'no answer'})"
                  + (f"; the start command's log ({START_LOG}) ends with:\n{tail}" if tail
                     else ""), sandbox_id=sandbox_id, image=name)


def needs_start(template: Mapping[str, Any] | None) -> bool:
    """Whether sandboxes of an image with this ``template`` manifest need ``run_template``."""
    return bool(template and (template.get("start") or template.get("ready")))
