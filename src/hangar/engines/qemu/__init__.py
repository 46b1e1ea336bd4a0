"""The QEMU engine: one QEMU ``microvm`` process per sandbox, driven over QMP.

One module per job:

    engine      ``QemuEngine``: boot, agent channel (virtio-serial), pause,
                resume, stop, memory, snapshot, restore, adopt
    argv        the command line: machine, devices, kernel arguments
                (``QemuCommand``), memory tuning (``MemoryTuning``)
    qmp         the QMP client: one command, or a session of several
    migration   snapshots over the migration stream: saving and loading the
                state through a passed file descriptor, the VM's shape
    streampipe  the stream compressed on its way to and from disk: a zstd
                process at the far end of the pipe QEMU gets
    template    template memory: a template's RAM saved once, each clone
                mapping it copy-on-write from a sealed memfd
    disk        the qcow2 overlay over the image's rootfs (``qemu-img``)
    probe       what the host offers: QEMU's version, KVM (a probe boot,
                cached), KSM, the TSC clock

Files of one sandbox (``hangar.layout.SandboxPaths``)::

    <sandbox>/
      disk.qcow2     the writable disk: a qcow2 overlay over the image's rootfs
      qmp.sock       QMP socket
      agent.sock     the agent's virtio-serial port (``hangar.agent``)
      serial.log     guest console (QEMU's stdout, capped)
      vmm.log        QEMU's stderr
      vmm.pid        QEMU's pid

A template's source VM also has ``memory.ram`` (its RAM, mapped shared).

A snapshot (``hangar.layout.SnapshotPaths``) holds ``state.mig`` (the
migration stream, zstd-compressed when it holds RAM), ``disk.qcow2`` (a copy of the overlay) and
``snapshot.json`` (its manifest, ``hangar.engines.snapshot_io``); a
template's also ``memory.ram`` (``template``).
"""

from hangar.engines.qemu.argv import (
    ASLR_CHOICES,
    BACKING_KEYS,
    BALLOON_ID,
    GUEST_KERNEL_ARGS,
    KERNEL_ARGS,
    MACHINE,
    MACHINE_FLAGS,
    RAM_ID,
    SECCOMP,
    TUNING_KEYS,
    MemoryTuning,
    QemuCommand,
    RamFile,
    tuning_from,
    without_tuning,
)
from hangar.engines.qemu.engine import (
    FILE_LIMIT_SLACK_MIB,
    HELLO_PROBE_S,
    STOP_GRACE_S,
    QemuEngine,
)
from hangar.engines.qemu.migration import (
    MIGRATE_BANDWIDTH,
    MIGRATE_S_PER_GIB,
    MIGRATE_TIMEOUT_S,
    MIGRATION_FD,
)
from hangar.engines.qemu.probe import (
    KSM_RUN,
    PROBE_MARKER,
    PROBE_TIMEOUT_S,
    QEMU,
    QEMU_IMG,
    choose_accel,
    host_tsc_khz,
    ksm_running,
    probe_kvm,
    qemu_version,
)

__all__ = [
    "ASLR_CHOICES",
    "BACKING_KEYS",
    "BALLOON_ID",
    "FILE_LIMIT_SLACK_MIB",
    "GUEST_KERNEL_ARGS",
    "HELLO_PROBE_S",
    "KERNEL_ARGS",
    "KSM_RUN",
    "MACHINE",
    "MACHINE_FLAGS",
    "MIGRATE_BANDWIDTH",
    "MIGRATE_S_PER_GIB",
    "MIGRATE_TIMEOUT_S",
    "MIGRATION_FD",
    "PROBE_MARKER",
    "PROBE_TIMEOUT_S",
    "QEMU",
    "QEMU_IMG",
    "RAM_ID",
    "SECCOMP",
    "STOP_GRACE_S",
    "TUNING_KEYS",
    "MemoryTuning",
    "QemuCommand",
    "QemuEngine",
    "RamFile",
    "choose_accel",
    "host_tsc_khz",
    "ksm_running",
    "probe_kvm",
    "qemu_version",
    "tuning_from",
    "without_tuning",
]
