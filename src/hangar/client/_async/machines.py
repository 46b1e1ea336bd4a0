"""Per-user machines (``/machines``): sandboxes that sleep when idle and wake on use;
the flat client's calls. See docs/snapshots-and-machines.md.

Mixed into ``AsyncHangar``; its methods run on the flat client (``self``). Source of
``hangar/client/_sync/machines.py``.
"""

from __future__ import annotations

import builtins
from collections.abc import Mapping, Sequence

from hangar.client import _core
from hangar.client._async.mixin import flat_client as _client
from hangar.schemas import ExecResult, MachineInfo, MachineList


class AsyncMachineCalls:
    """The flat client's machine methods (mixed into ``AsyncHangar``)."""

    # -- machines ---------------------------------------------------------------------------

    async def get_or_create_machine(self,
                                    user_id: str, *, idle_timeout: float | None = None,
                                    image: str | None = None, vcpus: int | None = None,
                                    memory_mib: int | None = None, disk_mib: int | None = None,
                                    idempotency_key: str | None = None,
                                    request_timeout: float | None = None,
                                    retry: bool | None = None) -> MachineInfo:
        """``POST /machines/{user_id}``: the user's machine, created if there is none.

        The options apply only when creating; ``idle_timeout`` is the idle
        seconds before it sleeps.
        """
        c = _client(self)
        body = _core.drop_none(idle_timeout=idle_timeout, image=image, vcpus=vcpus,
                               memory_mib=memory_mib, disk_mib=disk_mib)
        t = c._t(request_timeout, c.config.timeouts.lifecycle)
        return MachineInfo.model_validate(await c._json(
         "POST", f"/machines/{user_id}", json=body, timeout=t, retry=retry is not False,
         idempotency_key=idempotency_key or _core.new_idempotency_key()))

    async def get_machine(self, user_id: str, *, request_timeout: float | None = None,
                          retry: bool | None = None) -> MachineInfo:
        """``GET /machines/{user_id}``: the machine's state, unchanged. Raises NotFound."""
        c = _client(self)
        t = c._t(request_timeout, c.config.timeouts.control)
        return MachineInfo.model_validate(await c._json(
         "GET", f"/machines/{user_id}", timeout=t, retry=retry is not False))

    async def list_machines(self, *, request_timeout: float | None = None,
                            retry: bool | None = None) -> builtins.list[MachineInfo]:
        """``GET /machines``."""
        c = _client(self)
        t = c._t(request_timeout, c.config.timeouts.control)
        return MachineList.model_validate(await c._json(
         "GET", "/machines", timeout=t, retry=retry is not False)).machines

    async def sleep_machine(self,
                            user_id: str, *, request_timeout: float | None = None,
                            retry: bool | None = None) -> MachineInfo:
        """``POST /machines/{user_id}/snapshot``: snapshot the machine and stop its VM.

        Raises Busy while a command runs (retry shortly).
        """
        c = _client(self)
        t = c._t(request_timeout, c.config.timeouts.lifecycle)
        return MachineInfo.model_validate(await c._json(
         "POST", f"/machines/{user_id}/snapshot", timeout=t, retry=bool(retry)))

    async def wake_machine(self, user_id: str, *, request_timeout: float | None = None,
                           retry: bool | None = None) -> MachineInfo:
        """``POST /machines/{user_id}/wake``: restore the machine from its sleep snapshot."""
        c = _client(self)
        t = c._t(request_timeout, c.config.timeouts.lifecycle)
        return MachineInfo.model_validate(await c._json(
         "POST", f"/machines/{user_id}/wake", timeout=t, retry=bool(retry)))

    async def delete_machine(self,
                             user_id: str, *, request_timeout: float | None = None,
                             retry: bool | None = None) -> None:
        """``DELETE /machines/{user_id}``: the machine and everything it held."""
        c = _client(self)
        t = c._t(request_timeout, c.config.timeouts.lifecycle)
        await c._send("DELETE", f"/machines/{user_id}", timeout=t, retry=retry is not False)

    async def machine_exec(self, user_id: str, command: str, *,
                           args: Sequence[str] | None = None,
                           env: Mapping[str, str] | None = None, cwd: str | None = None,
                           stdin: str | bytes | None = None, timeout: float | None = None,
                           max_output: int | None = None, show_command: bool = False,
                           request_timeout: float | None = None,
                           retry: bool | None = None) -> ExecResult:
        """``POST /machines/{user_id}/exec``: run a command, waking the machine first.

        Arguments as for ``exec``; a wake can add some seconds.
        """
        c = _client(self)
        body = _core.exec_body(command, list(args) if args is not None else None, env, cwd,
                               stdin, timeout, max_output, show_command)
        t = c._t(request_timeout,
                 c.config.timeouts.exec(timeout) + c.config.timeouts.lifecycle)
        return ExecResult.model_validate(await c._json(
         "POST", f"/machines/{user_id}/exec", json=body, timeout=t, retry=bool(retry),
         idempotency_key=_core.new_idempotency_key() if retry else None))
