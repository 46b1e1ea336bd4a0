"""A built guest image as a VMM sees it: ``GuestImage``, its id and kernel command line.

Made by ``hangar.images.builder`` (``build_image``) and
``hangar.images.catalogue`` (``resolve_image``, ``resolve_pinned``); read by the
engines, the core and ``hangar.images.vmlinux``. A build's id is ``<name>-<digest>``:
its directory name under ``<data>/images`` (``hangar.layout``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KERNEL_CMDLINE = "console=ttyS0 root=/dev/vda rw panic=-1"
"""Kernel command line that boots these images (append ``hangar.*`` options)."""


@dataclass(frozen=True)
class GuestImage:
    """A built image, ready to boot: the paths a VMM needs.

    ``digest`` names this build's bytes (see ``hangar.images.builder``); records
    store ``name`` and ``digest``, which together are its ``id``.
    """

    name: str
    digest: str
    dir: Path
    kernel: Path
    initrd: Path
    """``initrd-<tag>.img`` for the current guest Python files."""
    rootfs: Path
    kernel_version: str
    cmdline: str = KERNEL_CMDLINE
    recipe_digest: str = ""
    vmlinux: Path | None = None
    """The ELF kernel when the manifest records it (else ``vmlinux.ensure_vmlinux``)."""
    template: Mapping[str, Any] | None = field(default=None, compare=False, hash=False)
    """For a template's build: what its sandboxes need at create (start command, ready
    check, default size; ``hangar.images.template_file.Template.runtime``), else None."""

    @property
    def id(self) -> str:
        """``<name>-<digest>``: the build's directory name, unique to its bytes."""
        return f"{self.name}-{self.digest}"


def image_id(name: str, digest: str) -> str:
    """The id of the build ``digest`` of recipe ``name``: ``<name>-<digest>``."""
    return f"{name}-{digest}"
