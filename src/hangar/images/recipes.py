"""Recipes: what goes into a guest image, by name.

A recipe is data only: a Debian suite, a debootstrap variant, the extra
packages and the kernel meta-package. ``hangar.images.builder`` turns one into
an image directory named ``<name>-<digest>``; the digest covers every field
that changes the built rootfs or kernel (not the description) plus
``BUILDER_VERSION``, so editing a recipe or the builder's rootfs set-up gives
a new image while an unchanged recipe reuses the cached one.

``desktop`` adds an X desktop that ``hangar.guest.desktop`` starts when the
kernel command line has ``hangar.desktop=WxHxD``: Xvfb, openbox, x11vnc,
xdotool and scrot (driven by ``hangar.core.desktop``), xterm with nano as a
small editor, Chromium, and fonts for Latin, CJK and symbols (DejaVu +
WenQuanYi Micro Hei: about 8 MB, against 90 MB for Noto CJK). debootstrap
installs Depends only, never Recommends, which keeps it near 1 GB.
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
    description="base plus an X desktop (Xvfb, openbox, x11vnc, xdotool, scrot, xterm + nano, "
                "Chromium, CJK fonts) for computer use and live viewing over VNC.",
    packages=BASE.packages + (
        "xvfb",                 # the X server (a framebuffer in memory); xkb data and xkbcomp
        "openbox",              # a light window manager: focus, stacking, decorations
        "x11vnc",               # VNC server on the X display, reached through the agent tunnel
        "xdotool",              # input: move, click, type, key; getmouselocation
        "scrot",                # screenshots as PNG
        "xterm",                # terminal (Xft, UTF-8) for nano and test windows
        "nano",                 # the small text editor typed into by the tests
        "chromium",             # the browser (run with --no-sandbox: the VM is the boundary)
        "fonts-dejavu-core",    # Latin, Greek, Cyrillic, many symbols (check mark, arrows)
        "fonts-wqy-microhei",   # CJK (Japanese, Chinese, Korean) in 5 MB
        "dbus-x11",             # provides dbus-session-bus, which GTK's dconf-service needs:
                                # debootstrap cannot pick providers of virtual packages
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
