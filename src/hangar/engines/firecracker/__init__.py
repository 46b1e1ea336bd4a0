"""The Firecracker engine: one ``firecracker`` process per sandbox, driven over its API.

One module per job:

    engine      ``FirecrackerEngine``: boot, agent channel (vsock), pause,
                resume, stop, snapshot, restore, adopt
    api         ``FirecrackerAPI``: a thin typed client of Firecracker's REST API
    files       a sandbox's files (``FirecrackerFiles``, named in
                ``hangar.layout.FirecrackerPaths``), ids, hard links, the writable drive
    jailer      ``JailerConfig``, cgroup discovery and limits
    snapshots   snapshot files: sparse memory, Diff merging, reading the manifest
    probe       the probe boot that tells whether a guest runs here
    binaries    finding and fetching the firecracker and jailer binaries

The kernel Firecracker boots (an ELF ``vmlinux``) is unpacked from the
image's bzImage when the image is built (``hangar.images.vmlinux``).

Files of one sandbox (``<sandbox>`` is ``SandboxPaths.dir``)::

    <sandbox>/
      vm.json              what was booted (ids, image, shape); read by adopt()
      vmm.pid              the VMM's pid
      serial.log           guest console (Firecracker's stdout)
      vmm.log              stderr of firecracker (or of the jailer: start failures)
      <root>/              Firecracker's working directory (its chroot when jailed):
        vmlinux            hard link of the image's vmlinux (copy across filesystems)
        initrd.img         hard link of the image's initramfs
        rootfs.ext4        hard link of the image's rootfs; attached read-only
        disk.ext4          the sandbox's writable drive (sparse ext4)
        firecracker.sock   API socket
        agent.sock         vsock host socket
        firecracker.log    Firecracker's own log (level Warning)
        snapshot.vmstate,  hard links of the snapshot being restored, if any
        snapshot.memory

``<root>`` is ``<sandbox>`` itself without the jailer, and
``<sandbox>/firecracker/hangar-<id>/root`` with it (the jailer builds that
tree, copies the binary into it and adds ``dev/kvm``, ``dev/net/tun``,
``dev/urandom``, ``dev/userfaultfd`` and ``firecracker.pid``). Without the
jailer the VMM runs as Hangar's user but still with a private working
directory holding only its own files.
"""

from hangar.engines.firecracker.api import FirecrackerAPI, FirecrackerAPIError
from hangar.engines.firecracker.binaries import binary_version, find_firecracker, find_jailer
from hangar.engines.firecracker.engine import AGENT_PORT, UNJAILED_REFUSED, FirecrackerEngine
from hangar.engines.firecracker.files import FirecrackerFiles, vm_id_for
from hangar.engines.firecracker.jailer import JailerConfig, cgroup_mounts, cgroup_version
from hangar.engines.firecracker.probe import PROBE_TIMEOUT_S, probe_boot, probe_boot_async
from hangar.engines.firecracker.snapshots import (
    dig_holes,
    merge_diff,
    read_snapshot,
    reports_holes,
)

__all__ = [
    "UNJAILED_REFUSED",
    "AGENT_PORT",
    "PROBE_TIMEOUT_S",
    "FirecrackerAPI",
    "FirecrackerAPIError",
    "FirecrackerEngine",
    "FirecrackerFiles",
    "JailerConfig",
    "binary_version",
    "cgroup_mounts",
    "cgroup_version",
    "dig_holes",
    "find_firecracker",
    "find_jailer",
    "merge_diff",
    "probe_boot",
    "probe_boot_async",
    "read_snapshot",
    "reports_holes",
    "vm_id_for",
]
