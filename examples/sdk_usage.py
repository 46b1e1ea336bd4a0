"""A typed tour of the SDK (checked by ``mypy --strict`` in the test suite).

Run it against a server: ``.venv/bin/python examples/sdk_usage.py``.
"""

from __future__ import annotations

import asyncio
import logging

from hangar.client import (
    AsyncHangar, AsyncSandbox, Event, ExecResult, Hangar, HealthMonitor, Machine, RetryPolicy,
    Sandbox, SandboxInfo, Timeouts,
)
from hangar.errors import HangarError, LimitExceeded, NotFound


def objects() -> None:
    with Sandbox.create(memory_mib=512, timeout=600) as sb:
        r: ExecResult = sb.exec("python3 -c 'print(6*7)'")
        print(r.stdout.strip(), r.exit_code, r.ok)
        sb.files.write("/root/hello.txt", "hello\n")
        assert sb.files.read("/root/hello.txt") == b"hello\n"
        for chunk in sb.exec_stream("for i in 1 2 3; do echo $i; sleep 0.1; done"):
            if chunk.type == "stdout":
                print(chunk.payload.decode(), end="")
        snap = sb.snapshot()
        with sb.fork(snap.id) as twin:
            print("fork", twin.id, twin.exec("cat /root/hello.txt").stdout)


def machines() -> None:
    m = Machine.get_or_create("alice", idle_timeout=1800)
    print(m.exec("uptime").stdout)
    m.sleep()
    m.wake()
    m.delete()


def flat() -> None:
    retry = RetryPolicy(delays=(1.0, 3.0))
    with Hangar(retry=retry, timeouts=Timeouts(control=10.0)) as h:
        boxes: list[SandboxInfo] = h.list()
        for b in boxes:
            print(b.id, b.state, b.memory_mib)
        try:
            h.get("sb-000000000000")
        except NotFound as exc:
            print("no such sandbox:", exc.message)
        except LimitExceeded as exc:
            print("retry after", exc.retry_after, "s")
        except HangarError as exc:
            print("failed:", exc.message, "unknown outcome" if exc.outcome_unknown else "")


def monitor(h: Hangar) -> None:
    def alert(error: HangarError, failures: int) -> None:
        logging.critical("Hangar down after %d checks: %s", failures, error.message)

    def recovered(down_for_s: float) -> None:
        logging.warning("Hangar back after %.0f s", down_for_s)

    with HealthMonitor(h, interval=60, threshold=3, on_alert=alert, on_recover=recovered):
        pass


def follow(h: Hangar) -> None:
    last: str | None = None
    for ev in h.events(kinds=["sandbox", "exec.finished"]):
        e: Event = ev
        print(e.kind, e.sandbox_id, e.data)
        last = e.id
        break
    h.publish_event("agent.tool.started", None, task_id="t1", tool="bash", summary="yarn test")
    print("resume after", last)


async def async_tour() -> None:
    async with AsyncHangar() as h:
        mark = await h.publish_event("agent.tour.started")
        sb = await AsyncSandbox.create(client=h)
        async with sb:  # killed at the end of the block
            r = await sb.exec("echo hi")
            print(r.stdout)
        # Replay what happened to it since the mark: created, exec.*, deleted.
        async for ev in h.events(sandbox_id=sb.id, last_event_id=mark.id):
            print(ev.kind, ev.data)
            if ev.kind == "sandbox.deleted":
                break


if __name__ == "__main__":
    objects()
    flat()
    asyncio.run(async_tour())
