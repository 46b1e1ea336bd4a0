"""The background-task helper (``hangar.core.tasks.Tasks``): one task per name, a crash
logged once, every task cancelled and awaited on stop."""

from __future__ import annotations

import asyncio
import logging

import pytest


def test_a_name_runs_one_task_and_is_free_once_it_ends() -> None:
    from hangar.core.tasks import Tasks

    async def main() -> None:
        tasks = Tasks("test")
        gate = asyncio.Event()
        runs: list[int] = []

        async def work(n: int) -> None:
            runs.append(n)
            await gate.wait()

        first = tasks.start("refill", work(1))
        second = tasks.start("refill", work(2))  # taken: the running task, work(2) closed
        assert second is first and tasks.running("refill") and tasks.names() == {"refill"}
        await asyncio.sleep(0)
        gate.set()
        await first
        await asyncio.sleep(0)
        assert not tasks.running("refill") and len(tasks) == 0
        gate.clear()
        third = tasks.start("refill", work(3))
        assert third is not first
        await asyncio.sleep(0)
        await tasks.stop()
        assert runs == [1, 3] and third.cancelled()

    asyncio.run(main())


def test_a_crash_is_logged_once_with_its_owner_and_name(
        caplog: pytest.LogCaptureFixture) -> None:
    from hangar.core.tasks import Tasks

    async def main() -> None:
        tasks = Tasks("pool")

        async def boom() -> None:
            raise RuntimeError("kaput")

        tasks.start("refill", boom())
        for _ in range(3):
            await asyncio.sleep(0)
        assert not tasks.running("refill")
        await tasks.stop()

    with caplog.at_level(logging.ERROR, logger="hangar.tasks"):
        asyncio.run(main())
    failed = [r for r in caplog.records if r.getMessage() == "background task failed"]
    assert len(failed) == 1
    assert failed[0].owner == "pool" and failed[0].task == "refill"  # type: ignore[attr-defined]
    assert isinstance(failed[0].exc_info[1], RuntimeError)  # type: ignore[index]
    # Retrieved by the helper: asyncio's "exception was never retrieved" never follows.
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


def test_stop_cancels_and_awaits_every_task_including_ones_started_while_stopping() -> None:
    from hangar.core.tasks import Tasks

    async def main() -> None:
        tasks = Tasks("reconcile")
        cleaned: list[str] = []

        async def loop(name: str) -> None:
            try:
                await asyncio.sleep(3600)
            finally:
                await asyncio.sleep(0.01)  # cleanup that itself awaits
                cleaned.append(name)
                if name == "loop":  # a task that starts another as it ends
                    tasks.start("late", loop("late"))

        for name in ("loop", "pass a", "sb-1"):
            tasks.start(name, loop(name))
        await asyncio.sleep(0)
        await tasks.stop(timeout_s=5)
        assert sorted(cleaned) == ["late", "loop", "pass a", "sb-1"]
        assert len(tasks) == 0

    asyncio.run(main())


def test_stop_gives_up_on_a_task_that_ignores_cancellation(
        caplog: pytest.LogCaptureFixture) -> None:
    from hangar.core.tasks import Tasks

    async def main() -> None:
        tasks = Tasks("terminals")
        release = asyncio.Event()

        async def stubborn() -> None:
            while not release.is_set():
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    continue

        tasks.start("sweeper", stubborn())
        await asyncio.sleep(0)
        await tasks.stop(timeout_s=0.2)
        assert tasks.running("sweeper")
        release.set()
        await tasks.stop(timeout_s=1)

    with caplog.at_level(logging.WARNING, logger="hangar.tasks"):
        asyncio.run(main())
    assert [r.getMessage() for r in caplog.records] == [
        "background tasks did not stop in time"]


def test_every_outlives_a_failing_step_and_awaits_async_ones(
        caplog: pytest.LogCaptureFixture) -> None:
    """``every``: a step that raises is logged and the loop goes on; an async step is
    awaited (never two at once); a sync one is called; cancelling ends the loop."""
    from hangar.core.tasks import Tasks, every

    log = logging.getLogger("test.every")

    async def main() -> None:
        calls: list[str] = []
        inside = 0

        async def step() -> None:
            nonlocal inside
            inside += 1
            assert inside == 1
            calls.append("async")
            await asyncio.sleep(0.02)
            inside -= 1
            if calls.count("async") == 2:
                raise RuntimeError("second step fails")

        tasks = Tasks("test")
        tasks.start("loop", every(0.001, step, log, "step failed"))
        tasks.start("sync", every(0.001, lambda: calls.append("sync"), log, "sync failed"))
        while calls.count("async") < 4:
            await asyncio.sleep(0.01)
        await tasks.stop()
        assert "sync" in calls and len(tasks) == 0

    with caplog.at_level(logging.ERROR, logger="test.every"):
        asyncio.run(main())
    failed = [r for r in caplog.records if r.name == "test.every"]
    assert [r.getMessage() for r in failed] == ["step failed"]
    assert failed[0].exc_info is not None and "second step fails" in str(failed[0].exc_info[1])


def test_race_ends_every_task_once_the_first_one_ends() -> None:
    """``race``: the tasks that ended first are returned; the others are cancelled and
    awaited before it returns."""
    from hangar.core.tasks import race

    async def main() -> None:
        async def quick() -> str:
            await asyncio.sleep(0.01)
            return "quick"

        slow = asyncio.create_task(asyncio.sleep(60))
        first = asyncio.create_task(quick())
        done = await race([slow, first])
        assert done == {first} and first.result() == "quick"
        assert slow.cancelled()

    asyncio.run(main())


def test_a_task_is_the_servers_own_work_whoever_started_it() -> None:
    """A task started while a team acts (a team's request) runs with no team acting, so a
    long-lived loop never sees the server through one team (``hangar.core.teams``)."""
    from hangar.core.tasks import Tasks
    from hangar.core.acting import acting, acting_for

    async def main() -> None:
        tasks = Tasks("test")
        seen: list[str | None] = []

        async def loop() -> None:
            seen.append(acting())

        with acting_for("red"):
            assert acting() == "red"
            await tasks.start("loop", loop())
            assert acting() == "red"  # the caller's own context is left as it was
        assert seen == [None]

    asyncio.run(main())
