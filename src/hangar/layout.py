"""The on-disk layout of a Hangar host, written down once.

Everything Hangar keeps lives under one data directory (``HANGAR_DATA_DIR``,
default ``/var/lib/hangar``)::

    <data>/
      api-key                   0600, the default API key (one line), generated on first
                                start, never logged; read by the CLI and SDK on this host
      api-keys                  0600, named API keys as SHA-256 hashes, one a line
                                (``hangar key add|rm|rotate``; see ``hangar.keys``)
      hangar.db                 SQLite store of sandbox records
      engine-probe.json         cached result of the KVM probe boot
      cache/
        debs/                   kernel packages fetched by ``apt-get download``
        debootstrap/            .debs kept by debootstrap --cache-dir
        build/                  temporary debootstrap trees (removed after each build)
      images/
        <name>-<hash>/          one built image; <hash> is ``Recipe.digest()``
          rootfs.ext4           read-only base disk (ext4, made by mkfs.ext4 -d)
          vmlinuz               Debian kernel (bzImage)
          modules/<kver>/       the kernel's full modules tree (depmod'ed)
          initrd-<tag>.img      busybox initramfs: virtio modules + the guest's
                                Python files; <tag> hashes those inputs, so it
                                is rebuilt (about a second) when the agent changes
          initrd.img            symlink to the newest initrd-<tag>.img
          manifest.json         recipe, digest, kernel version, sizes, build time
        <name> -> <name>-<hash> symlink to the newest build of a recipe
        .<name>.lock            flock held while building a recipe
      sandboxes/
        <id>/                   one sandbox's private directory, removed with it
          disk.qcow2            copy-on-write overlay over the image's rootfs
          qmp.sock              QEMU's QMP control socket
          agent.sock            guest agent channel (virtio-serial port)
          serial.log            guest console output
          vmm.pid               pid of the VMM process
      snapshots/
        <snapshot id>/          state.mig (VMM state and RAM), disk.qcow2 (copy of the
                                overlay), snapshot.json (manifest, written last);
                                see hangar.engines.snapshot_io

Sandbox directories are created by the engine on boot and removed on stop;
images are created by ``hangar.images.builder`` and only read afterwards,
except that ``hangar.images.builder.resolve_image`` adds an ``initrd-<tag>.img``
(and repoints ``initrd.img``) when the guest's Python files have changed. Use
the paths in the ``GuestImage`` that ``resolve_image`` returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Layout:
    """Paths under one data directory."""

    root: Path

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
    def probe_file(self) -> Path:
        return self.root / "engine-probe.json"

    @property
    def cache(self) -> Path:
        return self.root / "cache"

    @property
    def images(self) -> Path:
        return self.root / "images"

    @property
    def sandboxes(self) -> Path:
        return self.root / "sandboxes"

    @property
    def snapshots(self) -> Path:
        return self.root / "snapshots"

    def snapshot(self, snapshot_id: str) -> Path:
        return self.snapshots / snapshot_id

    def image_dir(self, name: str) -> Path:
        return self.images / name

    def sandbox(self, sandbox_id: str) -> "SandboxPaths":
        return SandboxPaths(self.sandboxes / sandbox_id)

    def ensure(self) -> None:
        """Create the top-level folders (mode 0700 for the root)."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o700)
        for p in (self.cache, self.images, self.sandboxes, self.snapshots):
            p.mkdir(exist_ok=True)


@dataclass(frozen=True)
class SandboxPaths:
    """Files of one sandbox; see the module docstring for who makes each."""

    dir: Path

    @property
    def disk(self) -> Path:
        return self.dir / "disk.qcow2"

    @property
    def qmp(self) -> Path:
        return self.dir / "qmp.sock"

    @property
    def agent(self) -> Path:
        return self.dir / "agent.sock"

    @property
    def serial_log(self) -> Path:
        return self.dir / "serial.log"

    @property
    def pid_file(self) -> Path:
        return self.dir / "vmm.pid"


@dataclass(frozen=True)
class ImagePaths:
    """Files of one built guest image."""

    dir: Path

    @property
    def rootfs(self) -> Path:
        return self.dir / "rootfs.ext4"

    @property
    def kernel(self) -> Path:
        return self.dir / "vmlinuz"

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
