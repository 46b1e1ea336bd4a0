"""Recipes: what goes into a guest image, by name.

A recipe is data only: a Debian suite, a debootstrap variant, the extra
packages and the kernel meta-package. ``hangar.images.builder`` turns one into
an image directory named ``<name>-<digest>``; the digest covers every field
that changes the built rootfs or kernel (not the description) plus
``BUILDER_VERSION``, so editing a recipe or the builder's rootfs set-up gives
a new image while an unchanged recipe reuses the cached one.

``desktop`` is defined for the desktop-sandbox work to come; nothing builds
it yet (it needs a rootfs of about a gigabyte).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

from hangar.errors import NotFound

BUILDER_VERSION = 2
"""Bump when the builder makes a different rootfs or kernel from the same recipe."""


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """One guest image's contents."""

    name: str
    packages: tuple[str, ...] = ()
    """Debian packages added to debootstrap's variant (``--include``)."""
    description: str = ""
    suite: str = "bookworm"
    variant: str = "minbase"
    kernel_package: str = "linux-image-cloud-amd64"
    """Meta-package naming the kernel; its versioned dependency is fetched."""

    def digest(self) -> str:
        """12 hex digits of sha256 over the build-relevant fields and ``BUILDER_VERSION``."""
        fields = dataclasses.asdict(self)
        fields.pop("description")
        fields["packages"] = sorted(self.packages)
        fields["builder_version"] = BUILDER_VERSION
        blob = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


BASE = Recipe(
    name="base",
    description="Debian 12 minbase with Python 3 (full standard library) and basic system tools.",
    packages=(
        "python3",          # python3.11 + libpython3.11-stdlib: asyncio, ssl, sqlite3, venv...
        "ca-certificates",
        "netbase",          # /etc/services, /etc/protocols for socket lookups
        "iproute2",
        "procps",
        "e2fsprogs",        # resize2fs, run by the guest init at boot
        "util-linux",
        "coreutils",
        "findutils",
        "less",
    ),
)

DESKTOP = Recipe(
    name="desktop",
    description="base plus an X desktop (Xvfb, openbox, Chromium) reachable over VNC. Not built in CI.",
    packages=BASE.packages + (
        "xvfb",
        "x11vnc",
        "xdotool",
        "scrot",
        "openbox",
        "xterm",
        "chromium",
        "fonts-dejavu-core",
        "fonts-liberation",
        "dbus-x11",
    ),
)

RECIPES: dict[str, Recipe] = {r.name: r for r in (BASE, DESKTOP)}


def get_recipe(name: str) -> Recipe:
    """The recipe called ``name``; raises ``NotFound`` for an unknown one."""
    try:
        return RECIPES[name]
    except KeyError:
        raise NotFound(
            f"no image recipe named {name!r} (known: {', '.join(sorted(RECIPES))})", image=name
        ) from None
