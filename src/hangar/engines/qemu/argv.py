"""QEMU's command line for one sandbox: the machine, its devices, the kernel's arguments.

Machine: ``-M microvm`` with virtio-mmio devices only: a virtio-blk disk
(the sandbox's qcow2 overlay over the image's read-only ext4 rootfs), a
virtio-serial port named ``hangar.agent`` on a Unix socket (the agent
channel; this host kernel has no vhost-vsock, so QEMU's vsock is not used),
a virtio-rng, a virtio-balloon (``MemoryTuning``), and the serial console
on QEMU's stdout. When the spec has a ``net`` (``hangar.net``), a
virtio-net NIC on its TAP (or on QEMU's user-mode stack) is added after them,
with ``hangar.net=`` on the kernel command line for the guest's
``hangar.guest.net``; without one, no NIC. Named volumes come last, one
raw virtio-blk drive each (``volume_args``).

The kernel is the image's ELF ``vmlinux`` when it has one, booted through
its PVH entry point: QEMU maps the file and copies its segments into guest
RAM, so the host holds the kernel once in its page cache for every VM, and
the guest skips decompressing itself. Without one (an image built before
``vmlinux`` existed), the bzImage ``vmlinuz``, whose bytes QEMU keeps in
its own heap for the VM's life (about 14 MiB per VM).

Memory (``MemoryTuning``, figures in docs/performance.md): under TCG, a
translation buffer of ``tb_mib`` (QEMU's default is 1 GiB, of which an
idle guest keeps about 200 MiB resident); a virtio-balloon with free page
reporting, so the pages the guest frees go back to the host, and guest
memory statistics every ``stats_interval_s``; guest RAM marked mergeable
for KSM only when ``ksm`` is set (QEMU's default marks it always).

Guest RAM is anonymous memory, except for a template (``RamFile``,
``hangar.engines.qemu.template``): a template's source VM holds its RAM in
a file it maps shared, and each clone maps the template's copy privately
(copy-on-write) through a ``memory-backend-file`` named ``RAM_ID``, the id
of microvm's default RAM block, so the migration stream's RAM block has
the same name either way.

Only ``QemuCommand.machine_args`` (plus the fixed device list) must match
between a snapshot and its restore; the tuning (``TUNING_KEYS``), the RAM's
backing (``BACKING_KEYS``), the kernel command line and file paths may differ.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hangar.engines.base import VMSpec

if TYPE_CHECKING:
    from hangar.config import Settings

MACHINE = "microvm,pit=on,rtc=on"
MACHINE_FLAGS = ("-M", "-accel", "-cpu", "-smp", "-m")
"""The flags whose values fix a machine's shape (``QemuCommand.machine_args``)."""
SECCOMP = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
"""QEMU's ``-sandbox`` (seccomp) setting for every VMM."""
BALLOON_ID = "balloon0"
TUNING_KEYS = ("tb-size", "mem-merge")
"""Suboptions of ``-accel`` and ``-M`` that tune the host's memory, not the machine's shape:
snapshots neither record nor compare them."""
BACKING_KEYS = ("memory-backend",)
"""Suboptions of ``-M`` that say where guest RAM lives (``RamFile``), not the machine's shape:
snapshots neither record nor compare them."""
RAM_ID = "microvm.ram"
"""The id of a file-backed RAM backend: microvm's own name for its RAM block, so a
migration stream's block matches whichever backing the other side has."""
KERNEL_ARGS = ("console=ttyS0", "root=/dev/vda", "rw", "quiet", "panic=-1")
GUEST_KERNEL_ARGS = ("cryptomgr.notests",)
"""Kernel options for what a guest's boot does not need (docs/performance.md, "Boot"):
the crypto self-tests, about 0.25 s of an emulated boot. Others were measured
(``mitigations=off``, ``audit=0``, ``nowatchdog``, no PS/2 or extra UART probing,
skipping initcalls) and made no difference worth a line here."""


@dataclass(frozen=True)
class MemoryTuning:
    """How a QEMU guest holds host memory; see the module docstring.

    ``tb_mib``: the TCG translation buffer per VM, MiB (ignored under KVM). It is
    touched as code is translated and flushed whole when full, so it costs what a
    guest's code fills and no more. 256 (docs/performance.md, "What the defaults
    are"): Chromium and Jupyter kernels fill a 48 MiB buffer over and over
    (a browser task's module ran in 52-70 s at 256 against 105 at 48; the code
    interpreter's in 207 against 281), while an idle sandbox restored from a
    template holds about 22 MiB more than at 48. At 16 a guest retranslates so
    often that an exec takes six times longer. ``balloon``: a virtio-balloon with
    free page reporting and memory statistics every ``stats_interval_s``
    seconds. ``ksm``: guest RAM may be merged with identical pages of other
    guests by the host's ksmd (which the operator starts; see docs/security.md
    for the side channel).

    ``aslr``: the guest kernel's address-space randomization of each process's
    mappings (None: on under KVM, off under TCG; off is the kernel's ``norandmaps``).
    TCG keys the code it translates by virtual address, so a library mapped at a new
    address in every process is translated again in every process: a spawn of
    ``/bin/true`` took 22-27 ms with it and 5.5-6.9 ms without (docs/performance.md,
    "The guest's own spawn"). Under KVM nothing is translated and it stays on.
    """

    tb_mib: int = 256
    balloon: bool = True
    ksm: bool = False
    stats_interval_s: int = 5
    aslr: bool | None = None


ASLR_CHOICES: dict[str, bool | None] = {"auto": None, "on": True, "off": False}
"""``HANGAR_GUEST_ASLR`` as ``MemoryTuning.aslr``."""


def tuning_from(settings: "Settings") -> MemoryTuning:
    """The ``MemoryTuning`` of a server's settings (``HANGAR_TCG_TB_MIB``,
    ``HANGAR_BALLOON``, ``HANGAR_KSM``, ``HANGAR_GUEST_ASLR``)."""
    return MemoryTuning(tb_mib=settings.tcg_tb_mib, balloon=settings.balloon,
                        ksm=settings.ksm, aslr=ASLR_CHOICES[settings.guest_aslr])


@dataclass(frozen=True)
class RamFile:
    """Guest RAM in a file (``memory-backend-file``) instead of anonymous memory.

    ``path``: the file as QEMU opens it (QEMU 7.2 opens it read-write
    whatever the mapping; a clone's is a sealed memfd, see
    ``hangar.engines.qemu.template``); ``shared``: ``share=on``, writes
    reach the file (a template's source), or ``share=off``, a private
    copy-on-write mapping (a template's clone).
    """

    path: str
    shared: bool


def without_tuning(machine: list[str]) -> list[str]:
    """``machine`` arguments without ``TUNING_KEYS`` and ``BACKING_KEYS`` suboptions
    (what snapshots compare)."""
    skip = (*TUNING_KEYS, *BACKING_KEYS)
    out = []
    for arg in machine:
        out.append(",".join(p for p in arg.split(",")
                            if p.split("=", 1)[0] not in skip) if "," in arg else arg)
    return out


@dataclass(frozen=True)
class QemuCommand:
    """QEMU's argv under one engine's settings.

    ``binary``: the QEMU executable; ``accel``: ``kvm`` or ``tcg``;
    ``seccomp``: add ``-sandbox SECCOMP``; ``tsc_khz``: the host's TSC rate
    (``probe.host_tsc_khz``), given to a TCG guest's kernel so that it
    skips calibrating its TSC against the PIT, which fails on a busy host.
    """

    binary: str
    accel: str
    tuning: MemoryTuning
    seccomp: bool
    tsc_khz: int | None

    def guest_kernel_args(self) -> tuple[str, ...]:
        """Kernel options this engine's settings add to every guest (``MemoryTuning.aslr``):
        ``("norandmaps",)`` when the guest's randomization is off, else none."""
        aslr = self.tuning.aslr if self.tuning.aslr is not None else self.accel == "kvm"
        return () if aslr else ("norandmaps",)

    def machine_args(self, spec: VMSpec) -> list[str]:
        """The QEMU arguments that fix the machine's shape.

        A snapshot can only be restored into a QEMU started with exactly
        these (plus the same devices, which ``command`` always adds in the
        same order), so snapshots record them and a restore compares.
        """
        cpu = "host" if self.accel == "kvm" else "max"
        accel = "kvm" if self.accel == "kvm" else "tcg,thread=multi"
        return ["-M", MACHINE, "-accel", accel, "-cpu", cpu,
                "-smp", str(spec.vcpus), "-m", f"{spec.memory_mib}M"]

    def tuned_machine_args(self, spec: VMSpec) -> list[str]:
        """``machine_args`` with the memory tuning: ``tb-size`` and ``mem-merge``."""
        machine = self.machine_args(spec)
        i = machine.index("-M") + 1
        machine[i] += f",mem-merge={'on' if self.tuning.ksm else 'off'}"
        if self.accel != "kvm":
            i = machine.index("-accel") + 1
            machine[i] += f",tb-size={self.tuning.tb_mib}"
        return machine

    def command(self, spec: VMSpec, tap_fd: int | None = None, *,
                balloon: bool | None = None, ram: RamFile | None = None,
                reporting: bool | None = None) -> list[str]:
        """The full QEMU argv for ``spec``; ``tap_fd``: an open TAP for its NIC;
        ``balloon`` overrides the tuning's and ``reporting`` the balloon's free page
        reporting (default: only with anonymous RAM; restores keep the devices
        their snapshot has); ``ram``: guest RAM in that file (``ram_args``), else
        anonymous memory.

        The serial console is QEMU's stdout (``VMMProcesses.spawn`` sends it
        to the capped console log); with seccomp on, QEMU may not spawn,
        raise privileges, use obsolete calls or change its own scheduling
        (``SECCOMP``).
        """
        p = spec.paths
        args = [*KERNEL_ARGS, *GUEST_KERNEL_ARGS, *self.guest_kernel_args(),
                f"hangar.hostname={spec.hostname}"]
        if self.accel != "kvm" and self.tsc_khz:
            args += [f"tsc_early_khz={self.tsc_khz}", "tsc=reliable"]
        if spec.net is not None:
            args.append(spec.net.kernel_arg())
        append = " ".join([*args, *spec.kernel_args])
        kernel = spec.image.vmlinux if spec.image.vmlinux is not None else spec.image.kernel
        if balloon is None:
            balloon = self.tuning.balloon
        machine = self.tuned_machine_args(spec)
        if ram is not None:
            machine[machine.index("-M") + 1] += f",memory-backend={RAM_ID}"
        return [
            self.binary, "-name", f"hangar-{spec.sandbox_id}",
            *machine, *self.ram_args(spec, ram),
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            *(["-sandbox", SECCOMP] if self.seccomp else []),
            "-kernel", str(kernel), "-initrd", str(spec.image.initrd),
            "-append", append,
            "-drive", f"id=root,file={p.disk},format=qcow2,if=none,discard=unmap",
            "-device", "virtio-blk-device,drive=root",
            "-device", "virtio-serial-device",
            "-chardev", f"socket,id=agent,path={p.agent},server=on,wait=off",
            "-device", "virtserialport,chardev=agent,name=hangar.agent",
            "-object", "rng-random,id=rng,filename=/dev/urandom",
            "-device", "virtio-rng-device,rng=rng",
            *self.balloon_args(balloon, reporting=ram is None if reporting is None else reporting),
            "-chardev", "stdio,id=console,signal=off",
            "-serial", "chardev:console",
            "-qmp", f"unix:{p.qmp},server=on,wait=off",
            *self.nic_args(spec, tap_fd),
            *self.volume_args(spec),
        ]

    @staticmethod
    def volume_args(spec: VMSpec) -> list[str]:
        """Each attached volume as a raw virtio-blk drive on its link in the sandbox folder
        (``SandboxPaths.volume``), read-only or not, with the serial the guest finds it by;
        after every other device, so a VM with volumes has the same devices before them."""
        out: list[str] = []
        for v in spec.volumes:
            out += ["-drive", f"id=vol{v.index},file={spec.paths.volume(v.index)},format=raw,"
                              f"if=none,readonly={'on' if v.read_only else 'off'}"
                              + ("" if v.read_only else ",discard=unmap"),
                    "-device", f"virtio-blk-device,drive=vol{v.index},serial={v.serial}"]
        return out

    def ram_args(self, spec: VMSpec, ram: RamFile | None) -> list[str]:
        """The ``memory-backend-file`` for ``ram`` ([] without one): ``spec.memory_mib``
        MiB, mergeable by KSM as the tuning says, its RAM block named ``RAM_ID``."""
        if ram is None:
            return []
        path = ram.path.replace(",", ",,")
        return ["-object", f"memory-backend-file,id={RAM_ID},mem-path={path},"
                           f"size={spec.memory_mib}M,share={'on' if ram.shared else 'off'},"
                           f"merge={'on' if self.tuning.ksm else 'off'},"
                           "x-use-canonical-path-for-ramblock-id=off"]

    def balloon_args(self, balloon: bool, reporting: bool = True) -> list[str]:
        """The virtio-balloon: free page reporting (unless not ``reporting``), and
        statistics polled every few seconds.

        Guests whose RAM is a file (``RamFile``: templates) have no free page
        reporting: QEMU 7.2 discards a reported page of a file-backed RAM by
        punching a hole into the file, even when it maps that file privately,
        which for a template's clone would mean its siblings' memory (the
        sealed copy refuses, and QEMU logs every refusal). A template's source
        has none either, so that its clones have the same devices.
        """
        if not balloon:
            return []
        return ["-device", f"virtio-balloon-device,id={BALLOON_ID},"
                           f"free-page-reporting={'on' if reporting else 'off'},"
                           f"guest-stats-polling-interval={self.tuning.stats_interval_s}"]

    @staticmethod
    def nic_args(spec: VMSpec, tap_fd: int | None = None) -> list[str]:
        """The NIC's QEMU arguments: [] without ``spec.net``.

        TAP: the NetworkManager made the TAP, so QEMU runs no scripts; a
        confined QEMU may not open ``/dev/net/tun``, so it gets the TAP as
        the open file ``tap_fd`` (``hangar.engines.vmm_exec`` opens it). User mode: QEMU's own
        stack on the attachment's subnet, IPv4 only.
        """
        net = spec.net
        if net is None:
            return []
        if net.kind == "tap" and tap_fd is not None:
            netdev = f"tap,id=net0,fd={tap_fd}"
        elif net.kind == "tap":
            netdev = f"tap,id=net0,ifname={net.tap},script=no,downscript=no"
        else:
            subnet = ipaddress.ip_interface(f"{net.ip}/{net.prefix}").network
            netdev = (f"user,id=net0,net={subnet},host={net.gateway},ipv6=off"
                      + (f",dns={net.dns}" if net.dns else ""))
        return ["-netdev", netdev, "-device", f"virtio-net-device,netdev=net0,mac={net.mac}"]


def has_balloon(argv: list[str]) -> bool:
    """Whether a QEMU argv (``/proc/<pid>/cmdline``) has the virtio-balloon."""
    return any(a.startswith("virtio-balloon-device") for a in argv)
