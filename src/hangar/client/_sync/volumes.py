# Generated from hangar/client/_async/volumes.py by scripts/gen_sync.py: do not edit.
"""Named volumes: the flat client's calls (``/volumes``), mixed into ``AsyncHangar``.

A volume is an ext4 filesystem that outlives sandboxes: make it here, attach
it at create (``create(volumes={"/data": "my-volume"})``, or
``{"/data": {"volume": "my-volume", "read_only": True}}``), and read its
files without a sandbox (``volume_files``, ``volume_read``). See
docs/volumes.md. Source of ``hangar/client/_sync/volumes.py``.
"""

from __future__ import annotations

import builtins

from hangar.client import _core
from hangar.client._sync.mixin import flat_client as _client
from hangar.errors import InvalidRequest
from hangar.schemas import VolumeFileEntry, VolumeFileList, VolumeFsck, VolumeInfo, VolumeList


class VolumeCalls:
    """The flat client's volume methods (mixed into ``AsyncHangar``)."""

    def create_volume(self, name: str, size_mib: int, *,
                            idempotency_key: str | None = None,
                            request_timeout: float | None = None,
                            retry: bool | None = None) -> VolumeInfo:
        """``POST /volumes``: an empty volume of ``size_mib`` MiB (16 to 1048576) named
        ``name``. Carries ``idempotency_key`` (a new one when None), so a retry never makes
        a second one. Raises InvalidRequest, Conflict (the name is taken)."""
        c = _client(self)
        return VolumeInfo.model_validate(c._json(
            "POST", "/volumes", json={"name": name, "size_mib": size_mib},
            retry=retry is not False,
            idempotency_key=idempotency_key or _core.new_idempotency_key(),
            timeout=c._t(request_timeout, c.config.timeouts.lifecycle)))

    def list_volumes(self, *, request_timeout: float | None = None,
                           retry: bool | None = None) -> builtins.list[VolumeInfo]:
        """``GET /volumes``: every volume, oldest first, with the sandboxes holding it."""
        c = _client(self)
        return VolumeList.model_validate(c._json(
            "GET", "/volumes", retry=retry is not False,
            timeout=c._t(request_timeout, c.config.timeouts.control))).volumes

    def get_volume(self, volume: str, *, request_timeout: float | None = None,
                         retry: bool | None = None) -> VolumeInfo:
        """``GET /volumes/{id}`` (an id or a name). Raises NotFound."""
        c = _client(self)
        return VolumeInfo.model_validate(c._json(
            "GET", f"/volumes/{volume}", retry=retry is not False,
            timeout=c._t(request_timeout, c.config.timeouts.control)))

    def resize_volume(self, volume: str, size_mib: int, *,
                            request_timeout: float | None = None,
                            retry: bool | None = None) -> VolumeInfo:
        """``PATCH /volumes/{id}``: grow it to ``size_mib`` MiB, offline. Raises NotFound,
        InvalidRequest (smaller than now), Conflict (a sandbox holds it)."""
        c = _client(self)
        return VolumeInfo.model_validate(c._json(
            "PATCH", f"/volumes/{volume}", json={"size_mib": size_mib},
            retry=retry is not False,
            timeout=c._t(request_timeout, c.config.timeouts.lifecycle)))

    def delete_volume(self, volume: str, *, request_timeout: float | None = None,
                            retry: bool | None = None) -> None:
        """``DELETE /volumes/{id}``: the volume and its data. Raises NotFound, Conflict (a
        sandbox holds it)."""
        c = _client(self)
        c._send("DELETE", f"/volumes/{volume}", retry=retry is not False,
                      timeout=c._t(request_timeout, c.config.timeouts.control))

    def fsck_volume(self, volume: str, *, request_timeout: float | None = None,
                          retry: bool | None = None) -> VolumeFsck:
        """``POST /volumes/{id}/fsck``: check and repair the volume's filesystem (``e2fsck -f
        -y`` on the host) once no sandbox holds it: the repair a ``volume_corrupt`` error
        names. Safe to repeat. Raises NotFound, Conflict (a sandbox holds it),
        VolumeCorrupt (beyond repair: restore it from a backup)."""
        c = _client(self)
        return VolumeFsck.model_validate(c._json(
            "POST", f"/volumes/{volume}/fsck", retry=retry is not False,
            timeout=c._t(request_timeout, c.config.timeouts.lifecycle)))

    def volume_files(self, volume: str, path: str = "/", *,
                           request_timeout: float | None = None,
                           retry: bool | None = None) -> builtins.list[VolumeFileEntry]:
        """``GET /volumes/{id}/files``: the entries of a folder of the volume, read on the
        host without a sandbox (at most 4096). Raises NotFound, InvalidRequest (a file)."""
        c = _client(self)
        resp = c._send("GET", f"/volumes/{volume}/files", params={"path": path},
                             retry=retry is not False,
                             timeout=c._t(request_timeout, c.config.timeouts.control))
        if not resp.headers.get("content-type", "").startswith("application/json"):
            raise InvalidRequest(f"{path} is a file, not a folder: use volume_read")
        return VolumeFileList.model_validate(resp.json()).entries

    def volume_read(self, volume: str, path: str, *,
                          request_timeout: float | None = None,
                          retry: bool | None = None) -> bytes:
        """``GET /volumes/{id}/files``: a file's bytes (at most 16 MiB), read on the host
        without a sandbox. Raises NotFound, InvalidRequest (a folder, or too large)."""
        c = _client(self)
        resp = c._send("GET", f"/volumes/{volume}/files", params={"path": path},
                             retry=retry is not False,
                             timeout=c._t(request_timeout, c.config.timeouts.transfer))
        if resp.headers.get("content-type", "").startswith("application/json"):
            raise InvalidRequest(f"{path} is a folder, not a file: list it (volume_files, "
                                 f"or hangar volume files)")
        return resp.content
