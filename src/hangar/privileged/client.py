"""The unprivileged server's end of the root helper (``hangar.roothelper``).

One typed method per request of ``hangar.privileged.protocol``, named like its
op: the method builds the request's strict model (so a request the helper
would refuse is refused here already, not sent), sends it as one JSON
message (descriptors as ``SCM_RIGHTS``), waits for the answer and returns
its result. Calls from several threads take turns. Every method raises
``InvalidRequest`` when the helper refused the request's content (a policy
the network cannot enforce: status 400) and ``EngineError`` otherwise (a
malformed request, a refusal against the host, the helper gone), with the
helper's message.

Nothing else spells a request: the engines, the VMM launcher and the
network manager get a ``Client`` (or None: no split) as a constructor
argument from whoever assembles the server (``hangar.cli.serve``,
``hangar.server``).
"""

from __future__ import annotations

import array
import json
import socket
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

from pydantic import BaseModel, ValidationError

from hangar.errors import EngineError, InvalidRequest
from hangar.privileged import protocol as P

__all__ = ["Client"]


class Client:
    """Requests to the helper over ``sock`` (a ``SOCK_SEQPACKET`` socketpair end)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._lock = threading.Lock()

    # -- the channel ----------------------------------------------------------------

    def _call(self, model: type[BaseModel], passed: Sequence[int] = (), /,
              **fields: Any) -> Any:
        """The result of the request ``model(**fields)``, sent with the descriptors
        ``passed``; raises as the module says."""
        try:
            request = model(**fields)
        except ValidationError as exc:
            raise EngineError(f"privileged helper: bad request: {exc.errors()[0]['msg']}"
                              ) from None
        data = request.model_dump_json().encode()
        anc = ([(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", passed).tobytes())]
               if passed else [])
        with self._lock:
            try:
                self.sock.sendmsg([data], anc)
                raw = self.sock.recv(P.MAX_MESSAGE)
            except OSError as exc:
                raise EngineError(f"privileged helper: {exc}") from None
        if not raw:
            raise EngineError("the privileged helper is gone")
        answer = json.loads(raw)
        if not answer.get("ok"):
            if answer.get("status") == 400:  # the request's own fault, e.g. a policy
                raise InvalidRequest(str(answer.get("error")))
            raise EngineError(f"privileged helper: {answer.get('error')}")
        return answer.get("result")

    # -- the helper itself ------------------------------------------------------------

    def ping(self) -> str:
        """``"pong"``: the helper answers (a start-up check)."""
        return str(self._call(P.Ping))

    # -- images pulled from a registry ------------------------------------------------

    def image_pull(self, name: str, ref: str, username: str | None = None,
                   password: str | None = None) -> None:
        """Start pulling ``ref`` as image ``name`` (``hangar.images.pull``) as root;
        raises InvalidRequest when the helper refuses it (a pull of ``name`` runs, too
        many run, a bad reference)."""
        self._call(P.ImagePull, name=name, ref=ref, username=username, password=password)

    def image_pull_wait(self, name: str, offset: int) -> P.PullProgress:
        """The pull of ``name``: ``{"exit", "lines", "offset"}``
        (``hangar.images.pull.Pulls.poll``)."""
        return cast(P.PullProgress, self._call(P.ImagePullWait, name=name, offset=offset))

    # -- QEMU's VMMs ------------------------------------------------------------------

    def prepare_vmm(self, sandbox_id: str, *, vcpus: int, memory_mib: int, accel: str,
                    tcg_cache_mib: int, reads: Iterable[str], owned: Iterable[str],
                    file_limit: int | None = None, host_network: bool = False,
                    view_fds: str | None = None, tap: str | None = None) -> P.Claim:
        """``Confinement.prepare`` of ``sandbox_id`` as root (see ``P.PrepareVmm``):
        ``reads`` are absolute folders of the images, ``owned`` names of files in the
        sandbox folder. The helper keeps the plan for ``spawn_vmm``."""
        return cast(P.Claim, self._call(
            P.PrepareVmm, sandbox_id=sandbox_id, vcpus=vcpus, memory_mib=memory_mib,
            accel=accel, tcg_cache_mib=tcg_cache_mib, reads=list(reads), owned=list(owned),
            file_limit=file_limit, host_network=host_network, view_fds=view_fds, tap=tap))

    def spawn_vmm(self, sandbox_id: str, argv: Sequence[str], fds: Sequence[int] = ()
                  ) -> P.Started:
        """Start QEMU (``argv``) under the plan ``prepare_vmm`` made; ``fds`` are passed
        to it under the same numbers."""
        return cast(P.Started, self._call(P.SpawnVmm, fds, sandbox_id=sandbox_id,
                                          argv=list(argv), fds=list(fds)))

    def kill_vmm(self, pid: int) -> None:
        """SIGKILL ``pid``, a process that runs as a VMM uid (nothing if it is gone)."""
        self._call(P.KillVmm, pid=pid)

    def release_vmm(self, sandbox_id: str) -> None:
        """Remove ``sandbox_id``'s cgroup and drop its VMM uid claim (and a jailed
        Firecracker's, when the helper runs the jailer)."""
        self._call(P.ReleaseVmm, sandbox_id=sandbox_id)

    def vmm_memory(self, pid: int) -> P.HostMemory | None:
        """The host memory of VMM ``pid``; None once it is gone."""
        return cast("P.HostMemory | None", self._call(P.VmmMemory, pid=pid))

    # -- the guest network ----------------------------------------------------------

    def net_info(self) -> P.NetStatus:
        """Whether TAP networking works on this host (``NetworkManager.available``)."""
        return cast(P.NetStatus, self._call(P.NetInfo))

    def net_start(self) -> None:
        """The bridge, sysctls and base rules (``NetworkManager.start``)."""
        self._call(P.NetStart)

    def net_attach(self, sandbox_id: str, policy: Mapping[str, Any]) -> dict[str, Any] | None:
        """``NetworkManager.attach`` under ``policy`` (a ``Policy`` as JSON): the
        fields of the ``NetAttachment`` made, or None (no NIC)."""
        return cast("dict[str, Any] | None",
                    self._call(P.NetAttach, sandbox_id=sandbox_id, policy=dict(policy)))

    def net_release(self, sandbox_id: str) -> None:
        """``NetworkManager.release``: the sandbox's TAP, rules and lease removed."""
        self._call(P.NetRelease, sandbox_id=sandbox_id)

    def net_sweep(self, live_ids: Iterable[str]) -> list[str]:
        """``NetworkManager.sweep``: the TAPs of sandboxes not in ``live_ids`` removed;
        their names."""
        return [str(t) for t in self._call(P.NetSweep, live_ids=list(live_ids))]

    def net_teardown(self) -> None:
        """``NetworkManager.teardown``: every TAP, both tables and the bridge."""
        self._call(P.NetTeardown)

    def net_leases(self) -> dict[str, str]:
        """Sandbox id -> guest address of every lease."""
        return {str(k): str(v) for k, v in self._call(P.NetLeases).items()}

    def net_guard(self, endpoints: Iterable[tuple[str, int]]) -> None:
        """``NetworkManager.guard_control``: (IPv4 address, TCP port) pairs no guest reaches."""
        self._call(P.NetGuard, endpoints=[(a, p) for a, p in endpoints])

    def net_intercept(self, sandbox_id: str, kind: str, port: int | None,
                      dports: Iterable[int]) -> None:
        """``kind`` ``tcp``: the guest's TCP to ``dports`` redirected to the gateway's
        ``port`` (``NetworkManager.intercept``); ``dns``: its DNS (``redirect_dns``);
        ``port`` None stops it."""
        self._call(P.NetIntercept, sandbox_id=sandbox_id, kind=kind, port=port,
                   dports=list(dports))

    def net_admit(self, sandbox_id: str,
                  entries: Iterable[tuple[str, int | None, int]]) -> None:
        """``NetworkManager.admit``: (IPv4 address, port or None, seconds) opened."""
        self._call(P.NetAdmit, sandbox_id=sandbox_id,
                   entries=[(a, p, s) for a, p, s in entries])

    def net_rules(self, sandbox_id: str, policy: Mapping[str, Any]) -> None:
        """``NetworkManager.set_rules`` with ``policy`` (a ``Policy`` as JSON)."""
        self._call(P.NetRules, sandbox_id=sandbox_id, policy=dict(policy))

    # -- Firecracker's jailer ---------------------------------------------------------

    def jail_prepare(self, sandbox_id: str) -> P.JailIds:
        """``HostJail.prepare``: the jailed VMM's uid claimed and its root made."""
        return cast(P.JailIds, self._call(P.JailPrepare, sandbox_id=sandbox_id))

    def jail_link(self, sandbox_id: str, links: Iterable[tuple[str, str]]) -> None:
        """``HostJail.link``: each (file under the data directory, its name in the
        VMM's root) hard-linked in."""
        self._call(P.JailLink, sandbox_id=sandbox_id, links=[(s, n) for s, n in links])

    def jail_spawn(self, sandbox_id: str, vcpus: int, memory_mib: int) -> P.Started:
        """``HostJail.spawn``: the prepared VMM started under the jailer."""
        return cast(P.Started, self._call(P.JailSpawn, sandbox_id=sandbox_id, vcpus=vcpus,
                                          memory_mib=memory_mib))

    def jail_release(self, sandbox_id: str) -> None:
        """``HostJail.release``: the jailed VMM's cgroups, jail and uid claim."""
        self._call(P.JailRelease, sandbox_id=sandbox_id)
