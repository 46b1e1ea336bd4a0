"""The on-disk layout of a Hangar host, written down once.

Every file Hangar keeps, and every file a VMM writes for it, is named here;
other modules take their paths from these classes and hold no path
literals of their own. Everything lives under one data directory
(``HANGAR_DATA_DIR``, default ``/var/lib/hangar``, mode 0700)::

    <data>/
      api-key                   0600, the default API key (one line), generated on first
                                start, never logged; read by the CLI and SDK on this host
      api-keys                  0600, named API keys as SHA-256 hashes, one a line
                                (``hangar key add|rm|rotate``; see ``hangar.keys``)
      hangar.db                 SQLite store of sandbox, snapshot, machine and port records
      port-key                  0600, 32 random bytes that sign exposed ports' URL tokens
                                (HMAC-SHA256; hangar.core.ports), generated on first use
      engine-probe.json         cached result of QEMU's KVM probe boot
      firecracker-probe.json    cached result of the Firecracker probe boot
      bin/                      firecracker and jailer, fetched by
                                hangar.engines.firecracker.binaries
      cache/                    root's, also under the privilege split (hangar.images.staging)
        debs/                   kernel packages fetched by ``apt-get download``
        debootstrap/            .debs kept by debootstrap --cache-dir; also apt's
                                archives when a template build installs packages
        apt-lists/              apt's package lists for template builds
        .apt.lock               flock held while a build uses those two
        build/                  temporary build trees (0700 each, removed after each build)
      images/
        <name>-<digest>/        one build of a recipe or template, never changed;
                                <name>-<digest> is its id (see below)
          rootfs.ext4           read-only base disk (ext4, made by mkfs.ext4 -d)
          vmlinuz               Debian kernel (bzImage), booted by QEMU
          vmlinux               the same kernel as an ELF, booted by Firecracker
          modules/<kver>/       the kernel's full modules tree (depmod'ed)
          initrd-<tag>.img      busybox initramfs: virtio modules + the guest's
                                Python files; <tag> hashes those inputs, so one
                                is added (about a second) when the agent changes
          initrd.img            symlink to the newest initrd-<tag>.img
          manifest.json         id, recipe, digests, kernel, sizes, build time
          template-snapshots/   booted snapshots of this build (hangar.core.templates):
            <key>/              one per key (engine, QEMU version, machine options,
                                disk, NIC, start/ready recipe): snapshot.json,
                                state.mig, disk.qcow2, memory.ram (SnapshotPaths);
                                made in .<key>.tmp-* and renamed, so a folder there
                                is whole; every create of the image restores it
            .<key>.lock         flock held while that snapshot is made or removed
        <name> -> <name>-<digest>  symlink to the current build of a recipe or template
        .<name>.lock            flock held while building (or collecting) a recipe
        .staging-<name>-*/      a build in progress (root's, 0700), renamed to <name>-<digest>
        .trash-*/               a build being removed by ``hangar image gc``
      sandboxes/
        <id>/                   one sandbox's private directory, removed with it
          vmm.pid               pid of the VMM process
          vmm.log               the VMM's own stdout and stderr (start failures)
          serial.log            guest console output (-> console/current when capped)
          console/              multilog: current and up to 3 rotated files (the VMM's)
          vmm.cgroup            the VMM's cgroup directories, one a line
          .view/                empty; the VMM's private root is mounted on it in its
                                own mount namespace (hangar.engines.confine)
          disk.qcow2            QEMU: copy-on-write overlay over the image's rootfs
          qmp.sock              QEMU: the QMP control socket
          agent.sock            QEMU: the agent channel (virtio-serial port)
          vm.json               Firecracker: what was booted; read on adoption
          firecracker/hangar-<id>/root/   Firecracker under the jailer: its chroot
                                (without the jailer, the files below are in <id>/)
            vmlinux, initrd.img, rootfs.ext4   hard links of the image's files
            disk.ext4           the sandbox's writable drive (sparse ext4)
            firecracker.sock    Firecracker's API socket
            agent.sock          the vsock host socket (the agent channel)
            firecracker.log     Firecracker's own log
            snapshot.vmstate, snapshot.memory   hard links of a snapshot being restored
          volume-<n>.ext4       QEMU: a hard link of an attached volume's image (n: 0-3),
                                removed with the folder (hangar.core.volumes)
      snapshots/
        <snapshot id>/          snapshot.json (manifest, written last) and
                                QEMU: state.mig (device state and RAM), disk.qcow2
                                Firecracker: vmstate, memory, disk.ext4
                                (see hangar.engines.snapshot_io)
      volumes/
        <vol id>/volume.ext4    a named volume: a sparse ext4 image (mkfs.ext4, never
                                mounted on the host; hangar.core.volumes), 0600 while
                                no VMM holds it
      secret-proxies/           0700 (hangar.core.secret_proxy)
        <sandbox id>/           0700, one running sandbox's secret proxy: mitmproxy-ca.pem
                                (0600, its CA's key and certificate), pid, proxy.log
                                (mitmproxy's errors); removed when the proxy stops. The
                                secrets' values are never written here (a pipe)
      backups/                  ``hangar backup``'s default folder (hangar.ops.backup)
      cluster-epochs.json       a cluster node's epoch of each sandbox it owns (hangar.cluster)
    /var/log/hangar/            root's, 0700 (HANGAR_RUN_DIR): hangar.pid and hangar.log of a
                                server started without systemd (scripts/nohup-server.sh);
                                never in the data directory, which is the split server's
    /etc/hangar/secrets.key     0600 (~/.config/hangar/secrets.key when not root): the
                                vault's 32-byte AES-256-GCM key (hangar.core.secrets;
                                HANGAR_SECRETS_KEY_FILE), made on first start; outside
                                the data directory, so ``hangar backup`` and a copy of
                                <data> never hold it

Image ids. A build's id is ``<name>-<digest>``, where ``<digest>`` is 12 hex
digits of the SHA-256 of its bytes (rootfs.ext4, vmlinuz and the modules
tree; see ``hangar.images.builder``), so a rebuild makes a new id and
never replaces a build in place. Builds made before ids covered the bytes
keep their old name, ``<name>-<recipe digest>``, and are not rebuilt in place
either. The initramfs is not part of the id: it is added beside the build
when this Hangar's guest files change, and a disk never points at it.

Sandbox directories are created by the engine on boot and removed on stop;
builds are created by ``hangar.images.builder`` and only read afterwards,
except that an ``initrd-<tag>.img`` may be added (and ``initrd.img``
repointed), and a build made before kernels were unpacked at build time
gets its ``vmlinux`` (recorded in its manifest) on first use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_ROOT = Path("/var/lib/hangar")
"""The data directory when ``HANGAR_DATA_DIR`` is not set."""
STAGING_PREFIX = ".staging-"
"""Name prefix of a build in progress in ``images`` (root's, 0700): ``image_staging_prefix``."""
TRASH_PREFIX = ".trash-"
"""Name prefix of a build being removed from ``images``: ``image_trash``."""
BUILD_CACHE = "build"
"""The folder of ``cache`` that holds the work trees of builds in progress: ``build_cache``."""


def default_root() -> Path:
    """``$HANGAR_DATA_DIR``, else ``DEFAULT_ROOT``."""
    return Path(os.environ.get("HANGAR_DATA_DIR") or DEFAULT_ROOT)


@dataclass(frozen=True)
class Layout:
    """Paths under one data directory."""

    root: Path

    @classmethod
    def from_env(cls) -> "Layout":
        """The layout of ``default_root()``."""
        return cls(default_root())

    @property
    def api_key_file(self) -> Path:
        return self.root / "api-key"

    @property
    def api_keys_file(self) -> Path:
        return self.root / "api-keys"

    @property
    def database(self) -> Path:
        return self.root / "hangar.db"

    @property
    def port_key_file(self) -> Path:
        """0600: the secret that signs exposed ports' URL tokens (``hangar.core.ports``)."""
        return self.root / "port-key"

    @property
    def qemu_probe_file(self) -> Path:
        """Cached answer of QEMU's KVM probe boot (``hangar.engines.qemu.choose_accel``)."""
        return self.root / "engine-probe.json"

    @property
    def firecracker_probe_file(self) -> Path:
        """Cached answer of the Firecracker probe boot (``hangar.engines.doctor``)."""
        return self.root / "firecracker-probe.json"

    @property
    def bin(self) -> Path:
        """Fetched VMM binaries (firecracker, jailer)."""
        return self.root / "bin"

    @property
    def cache(self) -> Path:
        return self.root / "cache"

    @property
    def debs_cache(self) -> Path:
        """Kernel .debs (``hangar.images.kernel``)."""
        return self.cache / "debs"

    @property
    def debootstrap_cache(self) -> Path:
        """debootstrap's ``--cache-dir``."""
        return self.cache / "debootstrap"

    @property
    def build_cache(self) -> Path:
        """Temporary debootstrap trees, one per build in progress."""
        return self.cache / BUILD_CACHE

    @property
    def apt_lists_cache(self) -> Path:
        """apt's package lists for ``apt-get install`` inside build trees (templates)."""
        return self.cache / "apt-lists"

    @property
    def apt_lock(self) -> Path:
        """flock held while a build uses the shared apt lists and .deb cache."""
        return self.cache / ".apt.lock"

    @property
    def images(self) -> Path:
        return self.root / "images"

    @property
    def sandboxes(self) -> Path:
        return self.root / "sandboxes"

    @property
    def snapshots(self) -> Path:
        return self.root / "snapshots"

    @property
    def volumes(self) -> Path:
        """Named volumes' folders (``hangar.core.volumes``)."""
        return self.root / "volumes"

    def volume(self, volume_id: str) -> "VolumePaths":
        """The files of one named volume."""
        return VolumePaths(self.volumes / volume_id)

    @property
    def secret_proxies(self) -> Path:
        """Running secret proxies' folders (``hangar.core.secret_proxy``)."""
        return self.root / "secret-proxies"

    @staticmethod
    def secrets_key_file() -> Path:
        """The vault's key by default, outside any data directory: ``/etc/hangar/secrets.key``
        as root, else ``$XDG_CONFIG_HOME/hangar/secrets.key`` (``~/.config``)."""
        if os.geteuid() == 0:
            return Path("/etc/hangar/secrets.key")
        config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
        return Path(config) / "hangar" / "secrets.key"

    @property
    def backups(self) -> Path:
        """Default folder of ``hangar backup``; made (0700) by it, not by ``ensure``."""
        return self.root / "backups"

    @property
    def cluster_epochs(self) -> Path:
        """A cluster node's epochs of the sandboxes it owns (``hangar.cluster.node``): a VMM
        whose sandbox's epoch in etcd differs was started before ownership moved."""
        return self.root / "cluster-epochs.json"

    def snapshot(self, snapshot_id: str) -> Path:
        """The directory of one snapshot (``SnapshotPaths`` names its files)."""
        return self.snapshots / snapshot_id

    def image_dir(self, name: str) -> Path:
        """``images/<name>``: a build's directory (by id) or a recipe's symlink (by name)."""
        return self.images / name

    def image(self, image_id: str) -> "ImagePaths":
        """The files of the build ``<name>-<digest>``."""
        return ImagePaths(self.images / image_id)

    def image_link(self, name: str) -> Path:
        """Symlink to the current build of recipe ``name``."""
        return self.images / name

    def image_lock(self, name: str) -> Path:
        """flock file held while recipe ``name`` is built or its old builds collected."""
        return self.images / f".{name}.lock"

    def image_staging_prefix(self, name: str) -> str:
        """Name prefix of the staging directories of builds of ``name`` in ``images``."""
        return f"{STAGING_PREFIX}{name}-"

    def image_trash(self, image_id: str) -> Path:
        """Where a build is renamed to just before it is deleted."""
        return self.images / f"{TRASH_PREFIX}{image_id}-{os.getpid()}"

    def sandbox(self, sandbox_id: str) -> "SandboxPaths":
        return SandboxPaths(self.sandboxes / sandbox_id)

    def ensure(self) -> None:
        """Create the top-level folders (mode 0700 for the root)."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o700)
        for p in (self.cache, self.images, self.sandboxes, self.snapshots, self.volumes):
            p.mkdir(exist_ok=True)


@dataclass(frozen=True)
class SandboxPaths:
    """Files of one sandbox; see the module docstring for who makes each."""

    dir: Path

    @property
    def pid_file(self) -> Path:
        return self.dir / "vmm.pid"

    @property
    def vmm_log(self) -> Path:
        """The VMM process's stdout and stderr (Firecracker: stderr only)."""
        return self.dir / "vmm.log"

    @property
    def serial_log(self) -> Path:
        """The guest's console: a file, or a symlink to ``console/current`` when
        ``multilog`` caps and rotates it (``hangar.engines.confine``)."""
        return self.dir / "serial.log"

    @property
    def console_dir(self) -> Path:
        """multilog's folder: ``current`` and up to 3 rotated ``@<time>.s`` files."""
        return self.dir / "console"

    @property
    def console_current(self) -> Path:
        return self.console_dir / "current"

    @property
    def cgroup_file(self) -> Path:
        """The VMM's cgroup directories, one a line (removed with the sandbox)."""
        return self.dir / "vmm.cgroup"

    @property
    def view_root(self) -> Path:
        """Empty folder on which the VMM's private root is mounted (in its namespace only)."""
        return self.dir / ".view"

    @property
    def disk(self) -> Path:
        """QEMU's qcow2 overlay."""
        return self.dir / "disk.qcow2"

    @property
    def qmp(self) -> Path:
        return self.dir / "qmp.sock"

    @property
    def agent(self) -> Path:
        """QEMU's agent socket (virtio-serial)."""
        return self.dir / "agent.sock"

    @property
    def vm_json(self) -> Path:
        """Firecracker: what was booted (ids, image, shape)."""
        return self.dir / "vm.json"

    def volume(self, n: int) -> Path:
        """QEMU: the hard link of the sandbox's ``n``-th attached volume image."""
        return self.dir / f"volume-{n}.ext4"

    def firecracker(self, vm_id: str, jailed: bool,
                    base: Path | None = None) -> "FirecrackerPaths":
        """The files of this sandbox's Firecracker VMM with ``--id vm_id`` (jailed under
        ``base`` when given, else in this folder)."""
        return FirecrackerPaths(self, vm_id, jailed, base)


@dataclass(frozen=True)
class VolumePaths:
    """Files of one named volume (``hangar.core.volumes``)."""

    dir: Path

    @property
    def image(self) -> Path:
        """The volume's sparse ext4 image."""
        return self.dir / "volume.ext4"


@dataclass(frozen=True)
class FirecrackerPaths:
    """Files of one Firecracker VMM: in ``root``, its working directory (its chroot when
    jailed). Firecracker's API takes every path relative to ``root``, so use ``.name``."""

    paths: SandboxPaths
    vm_id: str
    jailed: bool
    base: Path | None = None
    """The jailer's ``--chroot-base-dir`` when it is not the sandbox folder: a server
    split from root keeps its jails in a root-owned folder (``JailerConfig.chroot_base``)."""

    @property
    def root(self) -> Path:
        if self.jailed:
            return self.jail_base / "firecracker" / self.vm_id / "root"
        return self.paths.dir

    @property
    def jail_base(self) -> Path:
        """The jailer's ``--chroot-base-dir``: it builds ``<exec file name>/<vm id>/root``
        there, and Hangar runs only a binary named ``firecracker`` under it."""
        return self.base if self.base is not None else self.paths.dir

    @property
    def kernel(self) -> Path:
        return self.root / "vmlinux"

    @property
    def initrd(self) -> Path:
        return self.root / "initrd.img"

    @property
    def rootfs(self) -> Path:
        return self.root / "rootfs.ext4"

    @property
    def disk(self) -> Path:
        """The sandbox's writable drive."""
        return self.root / "disk.ext4"

    @property
    def api(self) -> Path:
        return self.root / "firecracker.sock"

    @property
    def vsock(self) -> Path:
        return self.root / "agent.sock"

    @property
    def log(self) -> Path:
        """Firecracker's own log (``--log-path``)."""
        return self.root / "firecracker.log"

    @property
    def restore_state(self) -> Path:
        return self.root / "snapshot.vmstate"

    @property
    def restore_memory(self) -> Path:
        return self.root / "snapshot.memory"

    @property
    def snapshot_state(self) -> Path:
        """Where ``PUT /snapshot/create`` writes the state before it is moved out."""
        return self.root / ".snap-vmstate"

    @property
    def snapshot_memory(self) -> Path:
        return self.root / ".snap-memory"

    @property
    def vmm_log(self) -> Path:
        return self.paths.vmm_log

    @property
    def vm_json(self) -> Path:
        return self.paths.vm_json


@dataclass(frozen=True)
class SnapshotPaths:
    """Files of one snapshot directory (``Layout.snapshot``)."""

    dir: Path

    @property
    def manifest(self) -> Path:
        """``snapshot.json``, written last: without it the snapshot is unfinished."""
        return self.dir / "snapshot.json"

    @property
    def state(self) -> Path:
        """QEMU's migration stream."""
        return self.dir / "state.mig"

    @property
    def state_partial(self) -> Path:
        """The migration stream while it is being written."""
        return self.dir / "state.mig.part"

    @property
    def disk(self) -> Path:
        """QEMU: copy of the qcow2 overlay."""
        return self.dir / "disk.qcow2"

    @property
    def fc_state(self) -> Path:
        """Firecracker's device state."""
        return self.dir / "vmstate"

    @property
    def fc_memory(self) -> Path:
        """Firecracker's guest memory file (sparse)."""
        return self.dir / "memory"

    @property
    def fc_disk(self) -> Path:
        """Firecracker: copy of the writable drive."""
        return self.dir / "disk.ext4"


@dataclass(frozen=True)
class ImagePaths:
    """Files of one built guest image."""

    dir: Path

    @property
    def id(self) -> str:
        """``<name>-<digest>``."""
        return self.dir.name

    @property
    def rootfs(self) -> Path:
        return self.dir / "rootfs.ext4"

    @property
    def kernel(self) -> Path:
        """The bzImage (QEMU boots it)."""
        return self.dir / "vmlinuz"

    @property
    def vmlinux(self) -> Path:
        """The uncompressed ELF kernel (Firecracker boots it)."""
        return self.dir / "vmlinux"

    @property
    def initrd(self) -> Path:
        """Symlink to the newest ``initrd-<tag>.img``."""
        return self.dir / "initrd.img"

    def initrd_for(self, tag: str) -> Path:
        """The initramfs built for one set of guest files (see ``hangar.images.initramfs``)."""
        return self.dir / f"initrd-{tag}.img"

    @property
    def modules(self) -> Path:
        """Holds ``<kernel version>/``, the kernel's modules tree."""
        return self.dir / "modules"

    @property
    def manifest(self) -> Path:
        return self.dir / "manifest.json"

    @property
    def template_snapshots(self) -> Path:
        """``template-snapshots/``: the build's booted snapshots (``hangar.core.templates``),
        one folder per key (``<key>/``, ``SnapshotPaths``), each with ``.<key>.lock`` beside
        it; removed with the build."""
        return self.dir / "template-snapshots"

    def template_snapshot(self, key: str) -> Path:
        """The booted snapshot of this build for ``key`` (hex digest of its inputs)."""
        return self.template_snapshots / key

    def template_snapshot_lock(self, key: str) -> Path:
        """flock file held while the snapshot for ``key`` is made or removed."""
        return self.template_snapshots / f".{key}.lock"
