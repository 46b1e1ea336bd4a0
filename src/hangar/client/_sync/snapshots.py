# Generated from hangar/client/_async/snapshots.py by scripts/gen_sync.py: do not edit.
"""Snapshots: the flat client's calls (``/sandboxes/{id}/snapshot``, ``/restore``,
``/snapshots``): save a running sandbox, bring it back, start new sandboxes from a
snapshot. See docs/snapshots-and-machines.md.

Mixed into ``AsyncHangar``; its methods run on the flat client (``self``). Source of
``hangar/client/_sync/snapshots.py``.
"""

from __future__ import annotations

import builtins
from collections.abc import Mapping

from hangar.client import _core
from hangar.client._sync.mixin import flat_client as _client
from hangar.schemas import SandboxInfo, Snapshot, SnapshotList


class SnapshotCalls:
    """The flat client's snapshot methods (mixed into ``AsyncHangar``)."""

    def snapshot(self, sandbox_id: str, *, idempotency_key: str | None = None,
                       request_timeout: float | None = None,
                       retry: bool | None = None) -> Snapshot:
        """``POST /sandboxes/{id}/snapshot``: save memory, devices and disk; it keeps running.

        Raises Busy (a command runs; retry shortly) or Conflict.
        """
        c = _client(self)
        t = c._t(request_timeout, c.config.timeouts.lifecycle)
        return Snapshot.model_validate(c._json(
            "POST", f"/sandboxes/{sandbox_id}/snapshot", timeout=t, retry=retry is not False,
            idempotency_key=idempotency_key or _core.new_idempotency_key()))

    def restore(self, sandbox_id: str, snapshot_id: str, *,
                      request_timeout: float | None = None,
                      retry: bool | None = None) -> SandboxInfo:
        """``POST /sandboxes/{id}/restore``: bring the sandbox back to one of its snapshots."""
        c = _client(self)
        t = c._t(request_timeout, c.config.timeouts.lifecycle)
        return SandboxInfo.model_validate(c._json(
            "POST", f"/sandboxes/{sandbox_id}/restore", json={"snapshot_id": snapshot_id},
            timeout=t, retry=bool(retry)))

    def fork(self, snapshot_id: str, *, timeout: float | None = None,
                   metadata: Mapping[str, str] | None = None,
                   idempotency_key: str | None = None, request_timeout: float | None = None,
                   retry: bool | None = None) -> SandboxInfo:
        """``POST /snapshots/{id}/sandboxes``: a new sandbox started from a snapshot.

        ``timeout`` is its time to live, seconds.
        """
        c = _client(self)
        body = _core.drop_none(timeout=timeout,
                               metadata=dict(metadata) if metadata is not None else None)
        t = c._t(request_timeout, c.config.timeouts.lifecycle)
        return SandboxInfo.model_validate(c._json(
            "POST", f"/snapshots/{snapshot_id}/sandboxes", json=body, timeout=t,
            retry=retry is not False,
            idempotency_key=idempotency_key or _core.new_idempotency_key()))

    def list_snapshots(self, sandbox_id: str | None = None, *,
                             request_timeout: float | None = None,
                             retry: bool | None = None) -> builtins.list[Snapshot]:
        """``GET /snapshots``: all snapshots, or those of one sandbox."""
        c = _client(self)
        t = c._t(request_timeout, c.config.timeouts.control)
        params = {"sandbox_id": sandbox_id} if sandbox_id else None
        return SnapshotList.model_validate(c._json(
            "GET", "/snapshots", params=params, timeout=t,
            retry=retry is not False)).snapshots

    def get_snapshot(self, snapshot_id: str, *, request_timeout: float | None = None,
                           retry: bool | None = None) -> Snapshot:
        """``GET /snapshots/{id}``. Raises NotFound."""
        c = _client(self)
        t = c._t(request_timeout, c.config.timeouts.control)
        return Snapshot.model_validate(c._json(
            "GET", f"/snapshots/{snapshot_id}", timeout=t, retry=retry is not False))

    def delete_snapshot(self, snapshot_id: str, *, request_timeout: float | None = None,
                              retry: bool | None = None) -> None:
        """``DELETE /snapshots/{id}``. Raises NotFound."""
        c = _client(self)
        t = c._t(request_timeout, c.config.timeouts.control)
        c._send("DELETE", f"/snapshots/{snapshot_id}", timeout=t,
                      retry=retry is not False)
