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
installs Depends only, never Recommends, which keeps it near 1 GB. Its
Chromium needs room: in a 512 MiB guest every tab crashes ("V8 process OOM
... CodeRange"), so the recipe carries a default size of 2 vCPUs and
2048 MiB (used when a create names none: Chromium's browser, GPU, network
and renderer processes all want a CPU, and on one emulated vCPU a form's
submit took minutes) and a ``/etc/chromium.d`` file with flags that
suit a VM (see ``CHROMIUM_FLAGS``).

``dev`` is the image of the agent tools' ``vm`` tier (``hangar.tools``):
git, Node.js with npm and yarn (Debian's ``yarnpkg``, also as ``yarn``),
Python 3 with venv and pip, ripgrep and the C build tools; 2 vCPUs and
2048 MiB by default.

``code-interpreter`` is the image of ``run_code`` (``hangar.core.interpreter``)
and of E2B's ``code-interpreter-v1``: Debian's ipykernel, jupyter_client,
numpy, pandas and matplotlib (installed with apt-get: numpy's ABI is a
virtual package), and a server (``files/code_interpreter.py``) that speaks
E2B's code interpreter protocol on port 49999. Its ``start`` command runs
the server, which starts the default kernel and imports numpy, pandas and
matplotlib in it, then starts and warms a spare kernel (what new contexts
and restarts are handed at once), before it opens the port, so the
``ready_port`` check passes only with both kernels warm and the booted
template snapshot (``hangar.core.templates``) holds both. A warm guest uses
about 330 MiB plus the spare's 130 MiB; the default is 1024 MiB for the
user's data and figures.

A recipe's ``start``, ``ready_port`` and ``ready_timeout_s`` shape a template's
start command and ready check (``Recipe.runtime``, what ``GuestImage.template``
holds for its builds); like the default size they leave the digest alone.
A recipe's ``default_vcpus`` and ``default_memory_mib`` are not part of the
image (they leave the digest alone): ``hangar.core.sandboxes`` gives them to
a sandbox of that image whose create names no size. ``files`` are written
into the rootfs after debootstrap, and ``apt_packages`` installed with apt-get
inside it first (both are part of the digest). Every recipe's files start with
``LOGIN_PROFILE``: Debian's login scripts without the two processes they start
on every login shell (E2B's SDK runs each command in one), and every recipe's
packages ``bash-static``, Debian's statically linked build of the same bash, which
the builder makes ``/bin/bash`` (``hangar.images.debian.static_bash``: it starts in
a third of the dynamic one's time under emulation).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from hangar.errors import NotFound
from hangar.guest import paths

BUILDER_VERSION = 3
"""Bump when the builder makes a different rootfs or kernel from the same recipe."""


@dataclass(frozen=True)
class RecipeFile:
    """A file the builder writes into the rootfs: absolute ``path``, text, mode bits."""

    path: str
    content: str
    mode: int = 0o644


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
    apt_packages: tuple[str, ...] = ()
    """Packages installed by ``apt-get`` inside the new tree after debootstrap, for
    dependency graphs debootstrap's resolver cannot configure (virtual packages,
    cycles: Debian's npm and yarnpkg)."""
    files: tuple[RecipeFile, ...] = ()
    """Files written into the rootfs after debootstrap."""
    default_vcpus: int | None = None
    """vCPUs of a sandbox of this image whose create names none (None: the server's)."""
    default_memory_mib: int | None = None
    """Guest memory (MiB) of a sandbox of this image whose create names none."""
    start: str | None = None
    """A command started in the background when a sandbox of it boots, as a template's
    ``start`` (``hangar.core.startup``); not part of the image."""
    ready_port: int | None = None
    """The create answers once this guest port accepts (a template's ``[ready] port``)."""
    ready_timeout_s: float = 60.0

    def runtime(self) -> dict[str, Any] | None:
        """What its sandboxes need at create, shaped as a template's
        (``hangar.images.template_file.Template.runtime``), or None without a start
        command or ready check."""
        if self.start is None and self.ready_port is None:
            return None
        ready = None if self.ready_port is None else {
            "port": self.ready_port, "command": None, "timeout_s": self.ready_timeout_s,
            "interval_s": 0.5}
        return {"start": self.start, "workdir": None, "ready": ready, "env": {},
                "vcpus": self.default_vcpus, "memory_mib": self.default_memory_mib}

    def digest(self) -> str:
        """12 hex digits of sha256 over the build-relevant fields and ``BUILDER_VERSION``."""
        fields = dataclasses.asdict(self)
        for name in ("description", "default_vcpus", "default_memory_mib", "start",
                     "ready_port", "ready_timeout_s"):
            fields.pop(name)
        for name in ("files", "apt_packages"):  # absent when empty: old digests stay valid
            if not fields[name]:
                fields.pop(name)
        if "apt_packages" in fields:
            fields["apt_packages"] = sorted(self.apt_packages)
        fields["packages"] = sorted(self.packages)
        fields["builder_version"] = BUILDER_VERSION
        blob = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


ETC_PROFILE = """\
# /etc/profile: system-wide .profile file for the Bourne shell (sh(1))
# and Bourne compatible shells (bash(1), ksh(1), ash(1), ...).
# Hangar: Debian's, except that bash reads its user id from $EUID instead of
# starting `id -u` (a process: a tenth of a second under emulation).

if [ -n "${BASH_VERSION-}" ]; then
  _profile_uid=$EUID
else
  _profile_uid=$(id -u)
fi
if [ "$_profile_uid" -eq 0 ]; then
  PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
else
  PATH="/usr/local/bin:/usr/bin:/bin:/usr/local/games:/usr/games"
fi
export PATH

if [ "${PS1-}" ]; then
  if [ "${BASH-}" ] && [ "$BASH" != "/bin/sh" ]; then
    # The file bash.bashrc already sets the default PS1.
    # PS1='\\h:\\w\\$ '
    if [ -f /etc/bash.bashrc ]; then
      . /etc/bash.bashrc
    fi
  else
    if [ "$_profile_uid" -eq 0 ]; then
      PS1='# '
    else
      PS1='$ '
    fi
  fi
fi
unset _profile_uid

if [ -d /etc/profile.d ]; then
  for i in /etc/profile.d/*.sh; do
    if [ -r $i ]; then
      . $i
    fi
  done
  unset i
fi
"""

ROOT_PROFILE = """\
# ~/.profile: executed by Bourne-compatible login shells.
# Hangar: Debian's, except that `mesg n` runs on a terminal only (anywhere
# else it fails, "ttyname failed", at the cost of a process).

if [ "$BASH" ]; then
  if [ -f ~/.bashrc ]; then
    . ~/.bashrc
  fi
fi

if [ -t 0 ]; then
  mesg n 2> /dev/null || true
fi
"""

LOGIN_PROFILE = (
    RecipeFile("/etc/profile", ETC_PROFILE),
    RecipeFile(f"{paths.HOME}/.profile", ROOT_PROFILE),
)
"""Debian's login scripts without the processes they start for nothing.

E2B's SDK runs every command as ``/bin/bash -l -c CMD``: a login shell reads
/etc/profile and root's ~/.profile. Debian's run ``id -u`` and ``mesg n``,
two processes that made a login ``bash -c true`` cost 0.16 s against 0.05 s
for a plain one under TCG (``bench/e2b_envd_bench.py``). These are the same
files with the same result (PATH by user id, PS1 on a terminal, profile.d,
~/.bashrc for bash, ``mesg n`` on a terminal), less those two processes where
they change nothing. Every recipe has them."""

BASE = Recipe(
    name="base",
    description="Debian 12 minbase with Python 3 (full standard library) and basic system tools.",
    packages=(
        "python3",          # python3.11 + libpython3.11-stdlib: asyncio, ssl, sqlite3, venv...
        "ca-certificates",
        "netbase",          # /etc/services, /etc/protocols for socket lookups
        "iproute2",
        "procps",
        "e2fsprogs",        # ext4 tools (the guest init grows the root with their ioctl)
        "util-linux",
        "coreutils",
        "findutils",
        "less",
        "bash-static",      # made /bin/bash (hangar.images.debian.static_bash): E2B's
                            # login bash starts in a third of the time under emulation
    ),
    files=LOGIN_PROFILE,
)

CHROMIUM_IPC_CONNECTION_TIMEOUT_S = 600
"""Seconds a Chromium child process waits for the browser's connection before it quits."""

CHROMIUM_FLAGS = (
    "--no-sandbox",                       # runs as root; the VM is the boundary
    "--disable-dev-shm-usage",            # /dev/shm is small in a guest: use /tmp
    "--disable-gpu",                      # no GPU: software rendering only
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",    # no update, sync or safe-browsing traffic
    "--disable-component-update",
    "--disable-sync",
    "--renderer-process-limit=4",         # bounds memory when many tabs open
    "--password-store=basic",             # no keyring daemon in the guest
    f"--ipc-connection-timeout={CHROMIUM_IPC_CONNECTION_TIMEOUT_S}",
)
"""Flags Debian's ``chromium`` wrapper adds (``/etc/chromium.d/hangar``).

``--ipc-connection-timeout``: each child process (GPU, network service,
renderer) ends itself when the browser has not connected to it within 15 s,
Chromium's default. On a busy machine under TCG the browser's main thread
needs longer than that at start, so the first network service and renderer
quit, and the first tab stays blank for good: the window is white, its title
"Untitled", while a page opened later over DevTools renders (the desktop's
``/screenshot`` and VNC then never show it). Chromium passes the switch on to
every child."""

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
        "ripgrep",              # search_code of the agent tools' browser tier
    ),
    files=LOGIN_PROFILE + (
        RecipeFile("/etc/chromium.d/hangar",
                   "# Hangar: flags for Chromium in a microVM (read by /usr/bin/chromium).\n"
                   f'export CHROMIUM_FLAGS="$CHROMIUM_FLAGS {" ".join(CHROMIUM_FLAGS)}"\n'),
    ),
    default_vcpus=2,
    default_memory_mib=2048,
)

DEV = Recipe(
    name="dev",
    description="base plus developer tools for agents: git, Node.js with npm and yarn, "
                "Python 3 venv and pip, ripgrep, build-essential (the agent tools' vm tier).",
    packages=BASE.packages + (
        "git",
        "nodejs",
        "python3-venv",
        "python3-pip",
        "ripgrep",              # search_code
        "build-essential",      # gcc, g++, make, libc headers (native npm and pip builds)
        "curl",
        "openssh-client",       # git over ssh
        "xz-utils",
        "unzip",
    ),
    apt_packages=(
        "npm",
        "yarnpkg",              # Debian's yarn 1.x; /usr/local/bin/yarn runs it
    ),
    files=LOGIN_PROFILE + (
        RecipeFile("/usr/local/bin/yarn", '#!/bin/sh\nexec /usr/bin/yarnpkg "$@"\n', 0o755),
    ),
    default_vcpus=2,
    default_memory_mib=2048,
)

CODE_INTERPRETER_PORT = 49999
"""The guest port of the code interpreter's server (E2B's)."""
FILES = Path(__file__).resolve().parent / "files"
CODE_INTERPRETER_BESIDE = ("code_interpreter_node.js", "code_interpreter_charts.py",
                           "code_interpreter_data.py", "code_interpreter_r.R",
                           "CodeInterpreterJava.java",
                           "code_interpreter_kernels.py", "code_interpreter_jupyter.py")
"""The files the code interpreter's server loads from its own folder (written beside it)."""

CODE_INTERPRETER = Recipe(
    name="code-interpreter",
    description="base plus a stateful code interpreter: Python (ipykernel, jupyter_client, "
                "numpy, pandas and matplotlib), JavaScript and TypeScript (Node.js), "
                "Bash, R and Java, served on port 49999 in E2B's protocol.",
    packages=BASE.packages + ("ripgrep",       # search_code of the agent tools
                              "curl"),          # as in E2B's image (its tests poll with it)
    apt_packages=(                      # apt-get: numpy's ABI is a virtual package
        "python3-ipykernel",
        "python3-jupyter-client",
        "python3-numpy",
        "python3-pandas",
        "python3-matplotlib",
        "python3-matplotlib-inline",    # the kernel's inline backend: figures as PNG
        "fonts-dejavu-core",            # matplotlib's default font
        "nodejs",                       # JavaScript contexts (with node-acorn, a dependency)
        "node-typescript",              # TypeScript contexts: cells transpiled
        "r-base-core",                  # R contexts (Rscript running code_interpreter_r.R)
        "r-cran-jsonlite",              # the R driver's JSON lines
        "openjdk-17-jdk-headless",      # Java contexts (JShell; the driver is compiled at
                                        # each start, in memory)
    ),
    files=LOGIN_PROFILE + (
        RecipeFile(paths.CODE_INTERPRETER_SERVER,
                   (FILES / "code_interpreter.py").read_text(), 0o755),
        *(RecipeFile(str(PurePosixPath(paths.CODE_INTERPRETER_SERVER).with_name(name)),
                     (FILES / name).read_text(), 0o644)
          for name in CODE_INTERPRETER_BESIDE),
        RecipeFile("/etc/ipython/ipython_kernel_config.py",
                   "# Hangar: figures keep their size (figsize x dpi), tracebacks no colours.\n"
                   "c.InlineBackend.print_figure_kwargs = {'bbox_inches': None}\n"
                   "c.InteractiveShell.colors = 'NoColor'\n"),
    ),
    start=f"exec /usr/bin/python3 {paths.CODE_INTERPRETER_SERVER} "
          f"--port {CODE_INTERPRETER_PORT} --cwd {paths.HOME}",
    ready_port=CODE_INTERPRETER_PORT,
    ready_timeout_s=1200.0,               # a cold boot under TCG on a busy host: minutes
                                          # (two Python kernels and Node.js; over 10 at load 20)
    default_memory_mib=1024,
)

RECIPES: dict[str, Recipe] = {r.name: r for r in (BASE, DESKTOP, DEV, CODE_INTERPRETER)}


def get_recipe(name: str) -> Recipe:
    """The recipe called ``name``; raises ``NotFound`` for an unknown one."""
    try:
        return RECIPES[name]
    except KeyError:
        raise NotFound(
            f"no image recipe named {name!r} (known: {', '.join(sorted(RECIPES))})", image=name
        ) from None
