"""Launch and stop VMs: the NIC, the VMM, the agent handshake, clean-up on failure.

Boot and restore share one path (``Launcher.launch``): attach the
sandbox's NIC, start the VMM, register its runtime at once (so a delete
meets it), check the record is still in the state the caller expects,
connect the agent, then run the caller's ``ready`` step (for a restore:
set the guest's clock, reseed its entropy, give a copy its own identity,
renumber a fork's NIC). On any
failure the VM is stopped and the NIC released: nothing is left but the
record, which the caller resolves.

``Launcher.stop`` ends a sandbox's VM whether or not this process started
it: the registered runtime, else the VMM found by its pid (``adopt``).

``Launcher.reconnect`` opens a new agent connection to a VM that already
ran (adopted after a restart, or whose connection dropped) and proves it
with a ``hello`` request before handing it out: when a host goes away and
another connects, the guest may not see the change in time, so a HELLO
can be stale (sent into a session the agent has since closed) and the
first request lost. An unanswered probe means: close and connect again.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import shutil
import time
from collections.abc import Awaitable, Callable, Collection
from pathlib import Path
from typing import Any

from hangar.config import Settings
from hangar.core.context import Context
from hangar.core.lifecycle import State
from hangar.core.network import NetworkRules
from hangar.core.registry import Runtime
from hangar.core.secret_ca import install_ca_meta, make_ca
from hangar.core.secret_proxy import SecretProxies
from hangar.core.secrets import Vault, default_key_file
from hangar.core.startup import needs_start, run_template
from hangar.core.templates import TemplateSnapshots, nic_of
from hangar.core.store import SandboxRecord, SnapshotRecord
from hangar.core.testhooks import crash_point
from hangar.core.volumes import Volumes
from hangar.engines.base import VM, VMSpec, again_if_stalled
from hangar.engines.boot_phases import boot_phases
from hangar.engines.boot_phases import describe as describe_phases
from hangar.engines.snapshot_io import refresh_guest
from hangar.errors import Conflict, GuestError, HangarError, InvalidRequest, Timeout
from hangar.engines.agent_client import AgentClient, SessionRestarted, exec_meta
from hangar.guest import paths
from hangar.guest.desktop import CMDLINE_KEY
from hangar.images import GuestImage, resolve_pinned
from hangar.core.admission import default_size
from hangar.net import NetAttachment, NetworkManager, Policy
from hangar.privileged import Client

log = logging.getLogger("hangar.launch")

READY_TRIES = 3
"""Tries of a restored guest's first calls (clock, entropy, identity, NIC), each safe to
repeat, when the agent begins a new session before answering (``SessionRestarted``: a
guest saved while no host was connected greets the new host from a session it is
already closing)."""

Ready = Callable[[AgentClient, NetAttachment | None], Awaitable[None]]

PROBE_S = 2.0
"""How long a reconnected agent has to answer the ``hello`` probe, seconds."""


def network_manager(settings: Settings, helper: "Client | None" = None
                    ) -> NetworkManager | None:
    """The server's network manager, or None when guest networking is off; ``helper``:
    the root helper's client of a server split from root, to which it forwards."""
    if settings.network == "off":
        return None
    mode = "auto" if settings.network == "auto" else settings.network
    return NetworkManager(bridge=settings.net_bridge, pool=settings.net_pool,
                          dns=settings.net_dns, mode=mode,  # type: ignore[arg-type]
                          user_open=settings.net_user_open, helper=helper)


def renet_meta(net: NetAttachment) -> dict[str, Any]:
    """An exec that gives a restored guest's NIC ``net``'s MAC and address.

    What the guest has already is kept: a wake restores a sandbox's own NIC (same MAC,
    and the same address unless another sandbox took it meanwhile), and under emulation
    taking a link down and flushing its address cost seconds."""
    script = (
        f'PATH="$PATH:{paths.RUNTIME_BIN}"; '
        'dev=$(ls /sys/class/net | grep -v "^lo$" | head -n1); '
        'if [ "$(cat "/sys/class/net/$dev/address")" != "$1" ]; then '
        'ip link set dev "$dev" down; ip link set dev "$dev" address "$1"; '
        'ip addr flush dev "$dev"; '
        'elif [ -n "$5" ] && [ "$(ip -4 -o addr show dev "$dev" | grep -c " inet ")" = 1 ] '
        '&& ip -4 -o addr show dev "$dev" | grep -qF " inet $3 " '
        '&& ip route show default | grep -qF "default via $4 dev $dev" '
        '&& grep -qxF "nameserver $5" /etc/resolv.conf; then exit 0; fi; '
        f'py={paths.RUNTIME_PYTHON}; [ -x "$py" ] || py=python3; '
        'exec "$py" -c "import sys; from hangar.guest import net; net.configure(sys.argv[1])" "$2"'
    )
    return exec_meta(argv=["/bin/sh", "-c", script, "renet", net.mac, net.kernel_arg(),
                           f"{net.ip}/{net.prefix}", net.gateway, net.dns or ""],
                     env={"PYTHONPATH": paths.PYTHON_DIR}, timeout=20)


FLUSH = exec_meta(argv=[
    "/bin/sh", "-c", 'sync || { py=%s; [ -x "$py" ] || py=python3; '
    '"$py" -c "import os; os.sync()"; }' % paths.RUNTIME_PYTHON], timeout=60)
"""An exec that flushes the guest's file systems to its disk (``sync``, else Python's
``os.sync``): what a sleep that keeps the disk alone needs first."""
FLUSH_AGENT_S = 30.0
"""Longest ``Launcher.flush`` waits for a new agent connection, seconds."""

HOST_KEYS = exec_meta(argv=[
    "/bin/sh", "-c", "command -v ssh-keygen >/dev/null && [ -d /etc/ssh ] || exit 0; "
    "( ssh-keygen -A >/dev/null 2>&1 & ) ; exit 0"], timeout=20)
"""An exec that makes a restored guest's ssh host keys in the background, if it has sshd."""



def desktop_args(screen: str | None) -> tuple[str, ...]:
    """The kernel arguments of a sandbox with a desktop of ``screen`` (``"1024x768x24"``;
    none without one): part of its template snapshot's key."""
    return (f"{CMDLINE_KEY}={screen}",) if screen else ()

class Launcher:
    """Starts and stops sandboxes' VMs and NICs."""

    def __init__(self, ctx: Context, secret_key: bytes | None = None) -> None:
        self.ctx = ctx
        self.net = network_manager(ctx.settings, ctx.engine.helper)
        self.vault = Vault(ctx.store, ctx.settings.secrets_key_file
                           or default_key_file(), secret_key)
        """Secrets and sandboxes' placeholders (``hangar.core.secrets``)."""
        self.secret_proxies = SecretProxies(ctx, self.vault, self.net)
        """One egress proxy per running sandbox with secrets (``hangar.core.secret_proxy``)."""
        self.templates = TemplateSnapshots(ctx.settings, ctx.layout, ctx.engine, self.net,
                                           ctx.publish)
        self.volumes = Volumes(ctx)
        """Named volumes (``hangar.core.volumes``): attached at boot, released at the end."""
        self.rules = NetworkRules(ctx, self.net)
        """Live egress rules and the domain guard (``hangar.core.network``)."""
        self.secret_proxies.follow(self.rules.guard)

    # -- network -----------------------------------------------------------------

    def policy(self, requested: Any) -> dict[str, Any] | None:
        """The egress policy a sandbox gets, as stored; None means no NIC.

        Raises InvalidRequest for a bad policy, or one networking cannot
        honour here (e.g. ``internet`` filtering without TAP devices, or any
        NIC when networking is off).
        """
        if self.net is None:
            if requested not in (None, "none") and Policy.parse(requested).egress != "none":
                raise InvalidRequest("guest networking is off on this server (HANGAR_NETWORK)")
            return None
        if requested is None:
            requested = "internet" if self.net.mode == "tap" else "none"
        policy = self.net.check(requested)  # InvalidRequest when this mode cannot enforce it
        if policy.egress == "none":
            return None
        return policy.model_dump(mode="json")

    async def attach(self, rec: SandboxRecord) -> NetAttachment | None:
        if self.net is None or not rec.network:
            return None
        nic = await self.net.attach_async(rec.id, rec.network)
        self.secret_proxies.claim(rec.id)  # its HTTP(S) is its secret proxy's, not the guard's
        await self.rules.attached(rec.id, nic, rec.network)
        return nic

    async def detach(self, sandbox_id: str) -> None:
        """Release the sandbox's NIC; never raises (a state change must not stall on it)."""
        if self.net is None:
            return
        try:
            await self.rules.released(sandbox_id)
            await self.net.release_async(sandbox_id)
        except Exception as exc:
            log.warning("network release failed", extra={"sandbox_id": sandbox_id,
                                                           "error": str(exc)})

    # -- launch ----------------------------------------------------------------------

    def spec(self, rec: SandboxRecord, image: GuestImage,
             net: NetAttachment | None = None, disk_from: Path | None = None) -> VMSpec:
        kernel_args = self.kernel_args(rec)
        return VMSpec(rec.id, image, self.ctx.layout.sandbox(rec.id), rec.vcpus, rec.memory_mib,
                      rec.disk_mib, hostname=rec.id, kernel_args=kernel_args, net=net,
                      volumes=self.volumes.drives(rec.id), disk_from=disk_from)

    async def launch(self, rec: SandboxRecord, start: Callable[[NetAttachment | None], Awaitable[VM]],
                     expect: Collection[State], *, with_nic: bool = True,
                     ready: Ready | None = None, crash_step: str | None = None,
                     cold: bool = False) -> Runtime:
        """Start ``rec``'s VM with ``start(nic)`` and connect its agent.

        The runtime is registered as soon as the VMM runs. If the record has
        left ``expect`` by then (a delete took it), the VM is stopped and
        ``Conflict`` raised. On any failure nothing is left but the record.
        ``cold``: the guest boots from its kernel (the engine watches for a
        boot that can never finish: ``Engine.connect_agent``, ``BootStalled``).
        """
        ctx = self.ctx
        vm: VM | None = None
        rt: Runtime | None = None
        try:
            net = await self.attach(rec) if with_nic else None
            vm = await start(net)
            rt = Runtime(vm)
            ctx.registry.put(rec.id, rt)
            cur = ctx.store.update(rec.id, pid=vm.pid)
            if cur is None or cur.state not in expect:
                raise Conflict(f"sandbox {rec.id} was deleted while being started",
                               sandbox_id=rec.id)
            if crash_step:
                crash_point(crash_step)
            rt.agent = await ctx.engine.connect_agent(
                vm, ctx.settings.boot_deadline_s(ctx.engine.accel), cold=cold)
            if ready is not None:
                await ready(rt.agent, net)
            await self.secure(rec, rt.agent)
        except BaseException:
            if rt is not None and ctx.registry.get(rec.id) is rt:
                await ctx.registry.drop(rec.id)
            elif rt is not None and rt.agent is not None:
                await rt.agent.close()
            if vm is not None:
                await ctx.engine.stop(vm)
            await self.secret_proxies.stop(rec.id)
            await self.detach(rec.id)
            raise
        return rt

    # -- secrets -------------------------------------------------------------------------

    async def secure(self, rec: SandboxRecord, agent: AgentClient) -> None:
        """A sandbox with secrets: start its egress proxy and make its guest trust the
        proxy's CA (``hangar.core.secret_proxy``); nothing for one without."""
        ca = self.vault.ca(rec.id)
        if ca is None:
            return
        await self.secret_proxies.start(rec.id, rec.network)
        result = await agent.exec(install_ca_meta(ca[0]))
        if result.exit_code != 0:
            raise GuestError("the guest did not take its secret proxy's CA: "
                             + result.stderr.head.decode(errors="replace")[-200:], sandbox_id=rec.id)

    def bind_secrets(self, sandbox_id: str, wanted: dict[str, str]) -> None:
        """Give a new sandbox placeholders for ``wanted`` ({variable: secret}, checked by
        ``Vault.check_request``) and a CA of its own."""
        if wanted:
            cert, key = make_ca(sandbox_id)
            self.vault.bind(sandbox_id, wanted, cert, key)

    async def recover_secrets(self) -> None:
        """At start: end proxies a previous server left, forget bindings of sandboxes and
        snapshots that are gone, and start the proxy of each running sandbox with secrets
        (its guest trusts its CA already). A proxy that cannot start is logged; its
        sandbox's web traffic stays sent to a closed port (refused, never direct)."""
        self.secret_proxies.sweep()
        live = {r.id: r for r in self.ctx.store.visible()}  # failed ones may be restored
        snaps = {s.id for s in self.ctx.store.list(SnapshotRecord)}
        for owner in self.vault.owners():
            if owner not in live and owner not in snaps:
                self.vault.forget(owner)
        for rec in live.values():
            if rec.state in (State.RUNNING, State.UNRESPONSIVE) \
                    and self.vault.binding(rec.id) is not None:
                try:
                    await self.secret_proxies.start(rec.id, rec.network)
                except HangarError as exc:
                    log.error("secret proxy not restarted", extra={"sandbox_id": rec.id,
                                                                   "error": exc.message})

    async def boot(self, rec: SandboxRecord, image: GuestImage, expect: Collection[State],
                   crash_step: str | None = None, disk_from: Path | None = None) -> Runtime:
        """Boot ``rec``'s VM and wait for its agent, then for a template's start command and
        ready check (``hangar.core.startup``); on failure nothing is left but the record.
        ``disk_from``: a disk-only snapshot's folder whose disk it boots from
        (``VMSpec.disk_from``), else a new disk.

        The boot's phases (``hangar.engines.boot_phases``, up to the agent's
        HELLO) go to the log (``boot`` line) and to ``hangar_boot_phase_seconds``.
        A boot the engine finds can never finish (``BootStalled``) is made again
        from the start, ``BOOT_ATTEMPTS`` times in all (``again_if_stalled``;
        ``hangar_boot_stalls_total``).
        """
        template = image.template

        async def attempt() -> Runtime:
            started = time.monotonic()  # this boot's: the boot line leaves out a stalled one

            async def ready(agent: AgentClient, net: NetAttachment | None) -> None:
                self.publish_boot(rec.id, agent.hello, time.monotonic() - started)
                await self.volumes.mount(agent, rec.id)
                if template is not None and needs_start(template):
                    await run_template(agent, template, name=image.name, sandbox_id=rec.id)

            return await self.launch(
                rec, lambda net: self.ctx.engine.boot(self.spec(rec, image, net, disk_from)),
                expect, crash_step=crash_step, ready=ready, cold=True)

        return await again_if_stalled(attempt, {"sandbox_id": rec.id},
                                      self.ctx.metrics.boot_stalls.inc)

    async def boot_from(self, rec: SandboxRecord, snap: SnapshotRecord,
                        expect: Collection[State]) -> Runtime:
        """Boot ``rec``'s VM cold from the disk of the disk-only snapshot ``snap`` (a wake
        from a sleep that kept the disk alone): its files as they were, its processes and
        memory gone, a new kernel boot; a template's start command runs again (``boot``).
        Raises ImageMissing (409) when the image build the snapshot pins is gone, and what
        ``boot`` raises."""
        image = resolve_pinned(self.ctx.layout, snap.image, snap.image_digest)
        return await self.boot(rec, image, expect, disk_from=self.ctx.layout.snapshot(snap.id))

    async def flush(self, rt: Runtime, sandbox_id: str) -> None:
        """Have the guest write its file systems' dirty data to its disk (``FLUSH``), before
        a snapshot that keeps the disk alone. Raises GuestError (the flush failed),
        Timeout, and the agent's errors."""
        async with rt.connect_lock:
            if rt.agent is None or rt.agent.closed:
                rt.agent = await self.reconnect(rt.vm, FLUSH_AGENT_S)
            agent = rt.agent
        result = await agent.exec(FLUSH)
        if result.exit_code != 0 or result.timed_out:
            raise GuestError("the guest could not flush its file systems to its disk: "
                             + result.stderr.head.decode(errors="replace")[-200:],
                             sandbox_id=sandbox_id)

    async def start_new(self, rec: SandboxRecord, image: GuestImage, expect: Collection[State],
                        crash_step: str | None = None,
                        chosen: list[str] | None = None) -> tuple[Runtime, str]:
        """Bring up a new sandbox's VM: restored from its image's template snapshot
        (``hangar.core.templates``) when it can be, else booted cold; (runtime, source),
        source ``template`` or ``cold`` (also put in ``chosen`` as soon as it is known).
        On failure nothing is left but the record.

        Raises what ``boot``/``restore_template`` raise, and GuestError or
        Timeout when the template's start command or ready check fails.
        """
        snap = await self.template_for(rec, image)
        if chosen is not None:  # the caller's failure log names the path
            chosen[:] = ["cold" if snap is None else "template"]
        if snap is None:
            return await self.boot(rec, image, expect, crash_step=crash_step), "cold"
        rt = await self.restore_template(
            rec, image, snap, expect, crash_step="create.restoring" if crash_step else None)
        rt.template = snap
        return rt, "template"

    async def template_for(self, rec: SandboxRecord, image: GuestImage) -> Any:
        """The template snapshot folder ``rec`` can be restored from, or None (boot cold):
        only for the image's default size and disk (``templates`` module docstring), and
        without volumes (``hangar.core.volumes``)."""
        t = self.templates
        if not t.enabled or self.volumes.has(rec.id):  # volumes: booted (core.volumes)
            return None
        vcpus, memory = default_size(image, self.ctx.settings)
        if (rec.vcpus, rec.memory_mib, rec.disk_mib) != (
                vcpus, memory, self.ctx.settings.default_disk_mib):
            return None
        return await t.ensure(image, rec.vcpus, rec.memory_mib, rec.disk_mib,
                              self.kernel_args(rec),
                              nic_of(rec.network, self.net.mode) if self.net else None)

    async def restore_template(self, rec: SandboxRecord, image: GuestImage, snap: Any,
                               expect: Collection[State], crash_step: str | None = None
                               ) -> Runtime:
        """Start ``rec``'s VM from the template snapshot in ``snap`` and make it a machine
        of its own: clock and entropy (``refresh_guest``), hostname, machine-id and fork
        generation (``identity``), its NIC's MAC and address (``renet_meta``), and new
        ssh host keys when the image has sshd (made in the background: the template has
        none). On failure nothing is left but the record."""
        generation: list[int] = []

        async def ready(agent: AgentClient, net: NetAttachment | None) -> None:
            await refresh_guest(agent)
            generation.append(await self.identity(agent, rec.id))
            if net is not None:
                await agent.exec(renet_meta(net))
            await agent.exec(HOST_KEYS)

        rt = await self.launch(
            rec, lambda net: self.ctx.engine.restore(self.spec(rec, image, net), snap),
            expect, with_nic=bool(rec.network), ready=ready, crash_step=crash_step)
        rt.generation = generation[0] if generation else None
        return rt

    @staticmethod
    def kernel_args(rec: SandboxRecord) -> tuple[str, ...]:
        return desktop_args(rec.desktop)

    def publish_boot(self, sandbox_id: str, hello: dict[str, Any], took: float) -> None:
        phases = boot_phases(hello, took)
        for phase, seconds in phases.items():
            self.ctx.metrics.boot_phase_seconds.labels(phase).observe(seconds)
        log.info(f"boot {describe_phases(phases)}",
                 extra={"sandbox_id": sandbox_id,
                        **{f"{phase}_s": seconds for phase, seconds in phases.items()}})

    async def restore(self, rec: SandboxRecord, snap: SnapshotRecord,
                      expect: Collection[State]) -> Runtime:
        """Start ``rec``'s VM from ``snap``: agent connected, clock and entropy refreshed,
        and a NIC of its own (a fork has another MAC and address than its snapshot).

        A restore from a user snapshot (a fork, or a restore in place) makes
        a copy of a machine that may run more than once, so the guest gets an
        identity of its own (``identity``); the runtime's ``generation`` holds
        its new fork generation. A wake (the sandbox's own sleep snapshot,
        used once) keeps its identity.

        Raises ImageMissing (409) when the image build the snapshot pins is gone."""
        image = resolve_pinned(self.ctx.layout, snap.image, snap.image_digest)
        generation: list[int] = []

        async def ready(agent: AgentClient, net: NetAttachment | None) -> None:
            for tried in range(1, READY_TRIES + 1):
                try:
                    await refresh_guest(agent)
                    if snap.kind == "user" and not generation:
                        generation.append(await self.identity(agent, rec.id))
                    if net is not None:
                        await agent.exec(renet_meta(net))
                    return
                except SessionRestarted:
                    if tried == READY_TRIES:
                        raise
                    log.info("restored guest's first calls sent again to its agent's new "
                             "session", extra={"sandbox_id": rec.id, "try": tried + 1})

        # The NIC must match the snapshot's devices: a snapshot with one gets one.
        rt = await self.launch(
            rec, lambda net: self.ctx.engine.restore(self.spec(rec, image, net),
                                                     self.ctx.layout.snapshot(snap.id)),
            expect, with_nic=bool(snap.network), ready=ready)
        rt.generation = generation[0] if generation else None
        return rt

    async def identity(self, agent: AgentClient, sandbox_id: str) -> int:
        """Make a restored guest a machine of its own; returns its new fork generation.

        Hostname: the sandbox id; ``/etc/machine-id``: 16 fresh bytes from
        the host; fork generation: the next value of the server-wide
        ``fork_generation`` counter, so it grows along every lineage and no
        two copies share it (``hangar.guest.identity``).
        """
        generation = self.ctx.store.next_value("fork_generation")
        await agent.set_identity(hostname=sandbox_id, machine_id=secrets.token_hex(16),
                                 generation=generation)
        return generation

    async def reconnect(self, vm: VM, timeout: float) -> AgentClient:
        """A proven agent connection to a VM that already ran (see the module docstring).

        Raises ``Timeout`` when no connection is proven within ``timeout``
        seconds, or the engine's errors (e.g. the VMM exited).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        last = "no answer"
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise Timeout(f"the guest agent did not answer within {timeout:.0f} s ({last})",
                              sandbox_id=vm.sandbox_id)
            agent = await self.ctx.engine.connect_agent(vm, left)
            try:
                await asyncio.wait_for(agent.ping(), min(PROBE_S, max(0.1, left)))
                return agent
            except (asyncio.TimeoutError, HangarError) as exc:
                last = "a stale HELLO" if isinstance(exc, asyncio.TimeoutError) else exc.message
                await agent.close()
                log.info("agent reconnect retried", extra={"sandbox_id": vm.sandbox_id,
                                                           "reason": last})
            except BaseException:
                await agent.close()
                raise

    # -- stop ---------------------------------------------------------------------------

    def find_vm(self, sandbox_id: str, pid: int | None) -> VM | None:
        """The sandbox's running VMM: the registered one, else the one ``pid`` names."""
        rt = self.ctx.registry.get(sandbox_id)
        if rt is not None:
            return rt.vm
        paths = self.ctx.layout.sandbox(sandbox_id)
        for candidate in (pid, _pid_file(paths.pid_file)):
            if candidate and candidate > 1:
                vm = self.ctx.engine.adopt(sandbox_id, paths, candidate)
                if vm is not None:
                    return vm
        return None

    async def stop(self, sandbox_id: str, pid: int | None = None) -> None:
        """End the sandbox's VM (if any), remove its folder, release its NIC."""
        ctx = self.ctx
        vm = self.find_vm(sandbox_id, pid)
        await ctx.registry.drop(sandbox_id)
        paths = ctx.layout.sandbox(sandbox_id)
        if vm is not None:
            await ctx.engine.stop(vm)
        await self.secret_proxies.stop(sandbox_id)
        shutil.rmtree(paths.dir, ignore_errors=True)
        await self.detach(sandbox_id)


def _pid_file(path: Any) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None
