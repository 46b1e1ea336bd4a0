"""A thin typed client for Firecracker's REST API over its Unix socket.

One method per API path and verb, named after them (``put_machine_config``
is ``PUT /machine-config``), each sending exactly the JSON fields
Firecracker documents; optional fields left ``None`` are not sent, so
Firecracker applies its own defaults. Written against Firecracker v1.12.1
(``src/firecracker/swagger/firecracker.yaml`` of that release); fields
added later upstream (``track_dirty_pages`` and ``vsock_override`` on
snapshot load, ``/serial``) are absent here because 1.12 rejects unknown
fields.

Errors: every answer other than 2xx raises ``FirecrackerAPIError``, which
carries Firecracker's own ``fault_message``, the HTTP status and the
request's method and path. A socket that cannot be reached (the VMM died,
or has not created it yet) raises plain ``EngineError``.

The client is asynchronous (``httpx.AsyncClient`` over
``httpx.AsyncHTTPTransport(uds=...)``): a full snapshot of a large guest
takes seconds, which must not block the server's event loop. Firecracker
answers one request at a time; callers serialise their calls per VM.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx

from hangar.errors import EngineError

DEFAULT_TIMEOUT_S = 10.0
SNAPSHOT_TIMEOUT_S = 600.0
"""Snapshot create/load move the whole guest memory: allow minutes for large guests."""

VmState = Literal["Paused", "Resumed"]
SnapshotType = Literal["Full", "Diff"]
LogLevel = Literal["Error", "Warning", "Info", "Debug", "Trace", "Off"]


class FirecrackerAPIError(EngineError):
    """Firecracker answered a request with a status other than 2xx.

    ``fault_message`` is Firecracker's own explanation (its ``Error`` body),
    ``status`` the HTTP status, ``method`` and ``path`` the request.
    """

    def __init__(self, method: str, path: str, status: int, fault_message: str,
                 **context: Any) -> None:
        super().__init__(f"Firecracker {method} {path} failed ({status}): {fault_message}",
                         status_code=status, fault_message=fault_message, **context)
        self.method = method
        self.path = path
        self.status_code = status
        self.fault_message = fault_message


@dataclass(frozen=True)
class InstanceInfo:
    """``GET /``: ``state`` is ``Not started``, ``Running`` or ``Paused``."""

    id: str
    state: str
    vmm_version: str
    app_name: str


@dataclass(frozen=True)
class MachineConfig:
    """``GET /machine-config``; ``mem_size_mib`` in MiB."""

    vcpu_count: int
    mem_size_mib: int
    smt: bool
    track_dirty_pages: bool
    huge_pages: str | None = None
    cpu_template: str | None = None


def _drop_none(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if v is not None}


class FirecrackerAPI:
    """Client of one Firecracker process's API socket.

    ``socket_path`` is the host path of the socket (at most 107 bytes, the
    Unix socket limit). Use as an async context manager, or call ``close``.
    """

    def __init__(self, socket_path: Path | str, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.socket_path = Path(socket_path)
        if len(str(socket_path).encode()) > 107:
            raise EngineError(f"API socket path is longer than 107 bytes: {socket_path}")
        # Plain HTTP over a Unix socket: verify=False only skips loading the
        # CA bundle for TLS, which is never used and costs ~90 ms per client.
        self._client = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=str(socket_path), verify=False),
            base_url="http://localhost", timeout=timeout, verify=False)

    async def __aenter__(self) -> "FirecrackerAPI":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._client.aclose()

    async def request(self, method: str, path: str, body: dict[str, Any] | None = None,
                      timeout: float | None = None) -> Any:
        """Send one request; returns the decoded JSON body (None for 204).

        Raises FirecrackerAPIError for a non-2xx answer, EngineError when the
        socket cannot be reached or the answer does not come in ``timeout`` s.
        """
        kwargs: dict[str, Any] = {}
        if body is not None:
            kwargs["json"] = body
        if timeout is not None:
            kwargs["timeout"] = timeout
        try:
            r = await self._client.request(method, path, **kwargs)
        except httpx.TimeoutException:
            raise EngineError(f"Firecracker {method} {path}: no answer in time",
                              socket=str(self.socket_path)) from None
        except httpx.TransportError as exc:
            raise EngineError(f"Firecracker API at {self.socket_path} is unreachable: {exc}",
                              socket=str(self.socket_path)) from None
        if r.is_success:
            return r.json() if r.content else None
        try:
            fault = r.json().get("fault_message") or r.text
        except ValueError:
            fault = r.text or r.reason_phrase
        raise FirecrackerAPIError(method, path, r.status_code, str(fault).strip())

    async def wait_ready(self, timeout: float = 10.0, alive: Any = None) -> InstanceInfo:
        """Poll ``GET /`` until the API answers; returns the instance info.

        ``alive`` (a callable) returning False ends the wait early. Raises
        EngineError when the API does not answer within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            if alive is not None and not alive():
                raise EngineError("Firecracker exited before its API answered")
            if self.socket_path.exists():
                try:
                    return await self.get_instance_info()
                except FirecrackerAPIError:
                    raise
                except EngineError:
                    pass
            if time.monotonic() > deadline:
                raise EngineError(f"Firecracker API did not answer within {timeout:.0f} s",
                                  socket=str(self.socket_path))
            await asyncio.sleep(0.005)

    # -- GET ------------------------------------------------------------------

    async def get_instance_info(self) -> InstanceInfo:
        """``GET /``."""
        r = await self.request("GET", "/")
        return InstanceInfo(id=r["id"], state=r["state"], vmm_version=r["vmm_version"],
                            app_name=r.get("app_name", ""))

    async def get_version(self) -> str:
        """``GET /version``: e.g. ``1.12.1``."""
        return str((await self.request("GET", "/version"))["firecracker_version"])

    async def get_machine_config(self) -> MachineConfig:
        """``GET /machine-config``."""
        r = await self.request("GET", "/machine-config")
        return MachineConfig(vcpu_count=r["vcpu_count"], mem_size_mib=r["mem_size_mib"],
                             smt=r.get("smt", False),
                             track_dirty_pages=r.get("track_dirty_pages", False),
                             huge_pages=r.get("huge_pages"), cpu_template=r.get("cpu_template"))

    async def get_vm_config(self) -> dict[str, Any]:
        """``GET /vm/config``: every configured resource, as Firecracker reports it."""
        return dict(await self.request("GET", "/vm/config"))

    # -- pre-boot configuration -------------------------------------------------

    async def put_machine_config(self, vcpu_count: int, mem_size_mib: int, *,
                                 smt: bool | None = None, track_dirty_pages: bool | None = None,
                                 huge_pages: str | None = None) -> None:
        """``PUT /machine-config``: vCPUs (1..32) and memory in MiB. Pre-boot only."""
        await self.request("PUT", "/machine-config", _drop_none({
            "vcpu_count": vcpu_count, "mem_size_mib": mem_size_mib, "smt": smt,
            "track_dirty_pages": track_dirty_pages, "huge_pages": huge_pages}))

    async def put_boot_source(self, kernel_image_path: str, boot_args: str | None = None,
                              initrd_path: str | None = None) -> None:
        """``PUT /boot-source``: an uncompressed ELF ``vmlinux`` on x86_64. Pre-boot only.

        Paths are as Firecracker sees them: relative to its working
        directory, or inside its chroot under the jailer.
        """
        await self.request("PUT", "/boot-source", _drop_none({
            "kernel_image_path": kernel_image_path, "boot_args": boot_args,
            "initrd_path": initrd_path}))

    async def put_drive(self, drive_id: str, path_on_host: str, *, is_root_device: bool = False,
                        is_read_only: bool = False, cache_type: str | None = None,
                        io_engine: str | None = None, partuuid: str | None = None) -> None:
        """``PUT /drives/{drive_id}``: a virtio-blk drive. Pre-boot only.

        Guests name drives in the order they were added (``/dev/vda``,
        ``/dev/vdb``...), except that a root device comes first.
        """
        await self.request("PUT", f"/drives/{drive_id}", _drop_none({
            "drive_id": drive_id, "path_on_host": path_on_host,
            "is_root_device": is_root_device, "is_read_only": is_read_only,
            "cache_type": cache_type, "io_engine": io_engine, "partuuid": partuuid}))

    async def put_vsock(self, guest_cid: int, uds_path: str) -> None:
        """``PUT /vsock``: the vsock device, proxied through Unix socket ``uds_path``.

        Host-initiated connections connect to ``uds_path`` and send
        ``CONNECT <port>\\n``; guest-initiated ones reach ``<uds_path>_<port>``.
        ``guest_cid`` must be >= 3. Pre-boot only.
        """
        await self.request("PUT", "/vsock", {"guest_cid": guest_cid, "uds_path": uds_path})

    async def put_network_interface(self, iface_id: str, host_dev_name: str,
                                    guest_mac: str | None = None) -> None:
        """``PUT /network-interfaces/{iface_id}``: a virtio-net device on TAP ``host_dev_name``."""
        await self.request("PUT", f"/network-interfaces/{iface_id}", _drop_none({
            "iface_id": iface_id, "host_dev_name": host_dev_name, "guest_mac": guest_mac}))

    async def put_logger(self, log_path: str, level: LogLevel | None = None, *,
                         show_level: bool | None = None,
                         show_log_origin: bool | None = None) -> None:
        """``PUT /logger``: Firecracker's own log; ``log_path`` must already exist."""
        await self.request("PUT", "/logger", _drop_none({
            "log_path": log_path, "level": level, "show_level": show_level,
            "show_log_origin": show_log_origin}))

    async def put_metrics(self, metrics_path: str) -> None:
        """``PUT /metrics``: JSON metrics, flushed to ``metrics_path`` (must already exist)."""
        await self.request("PUT", "/metrics", {"metrics_path": metrics_path})

    # -- actions and state ------------------------------------------------------

    async def put_action(self, action_type: Literal["InstanceStart", "FlushMetrics",
                                                    "SendCtrlAltDel"]) -> None:
        """``PUT /actions``."""
        await self.request("PUT", "/actions", {"action_type": action_type})

    async def instance_start(self) -> None:
        """``PUT /actions`` ``InstanceStart``: boot the configured guest."""
        await self.put_action("InstanceStart")

    async def flush_metrics(self) -> None:
        """``PUT /actions`` ``FlushMetrics``: write the metrics file now."""
        await self.put_action("FlushMetrics")

    async def send_ctrl_alt_del(self) -> None:
        """``PUT /actions`` ``SendCtrlAltDel``: ask the guest to reboot (x86 i8042)."""
        await self.put_action("SendCtrlAltDel")

    async def patch_vm(self, state: VmState) -> None:
        """``PATCH /vm``: pause (``Paused``) or resume (``Resumed``) the vCPUs."""
        await self.request("PATCH", "/vm", {"state": state})

    # -- snapshots ----------------------------------------------------------------

    async def put_snapshot_create(self, snapshot_path: str, mem_file_path: str,
                                  snapshot_type: SnapshotType = "Full",
                                  timeout: float = SNAPSHOT_TIMEOUT_S) -> None:
        """``PUT /snapshot/create``: write the VM state and guest memory. VM must be paused.

        A ``Diff`` snapshot's memory file is sparse and holds only the pages
        dirtied since the previous snapshot (or load); it needs
        ``track_dirty_pages`` in the machine config (or
        ``enable_diff_snapshots`` on load).
        """
        await self.request("PUT", "/snapshot/create", {
            "snapshot_type": snapshot_type, "snapshot_path": snapshot_path,
            "mem_file_path": mem_file_path}, timeout=timeout)

    async def put_snapshot_load(self, snapshot_path: str, mem_backend_path: str, *,
                                mem_backend_type: Literal["File", "Uffd"] = "File",
                                enable_diff_snapshots: bool | None = None,
                                resume_vm: bool | None = None,
                                network_overrides: list[dict[str, str]] | None = None,
                                timeout: float = SNAPSHOT_TIMEOUT_S) -> None:
        """``PUT /snapshot/load``: restore into a fresh, unconfigured process.

        Drives and the vsock socket are reopened at the paths recorded in the
        snapshot (relative ones against this process's working directory).
        ``network_overrides`` items are ``{"iface_id", "host_dev_name"}``.
        """
        await self.request("PUT", "/snapshot/load", _drop_none({
            "snapshot_path": snapshot_path,
            "mem_backend": {"backend_type": mem_backend_type, "backend_path": mem_backend_path},
            "enable_diff_snapshots": enable_diff_snapshots, "resume_vm": resume_vm,
            "network_overrides": network_overrides}), timeout=timeout)
