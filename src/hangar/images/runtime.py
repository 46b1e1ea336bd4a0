"""Hangar's guest runtime: a Python interpreter (and two tools) that bring their own libraries.

The guest's init and agent are Python (standard library only). A Debian
recipe has python3; an OCI image may have none, or an old one, or one built
without a module the agent needs (ctypes), and may use another C library
(musl). So every template imported from an OCI image gets the runtime,
copied from the host, in ``/usr/lib/hangar/runtime``::

    bin/python3.X, bin/python3     the host's Debian interpreter (python3 package)
    bin/resize2fs, bin/ip          grow the root filesystem; set up the NIC
    lib/ld-linux-x86-64.so.2, lib/*.so.*   every shared library they need (ldd)
    lib/python3.X/                 the standard library with its .pyc files, without
                                   tests, idle, tkinter, ensurepip, lib2to3, distutils,
                                   pydoc data, site- and dist-packages

The three programs are patched (``patchelf``) to use that folder's dynamic
loader and libraries (interpreter and RPATH), so they run in any x86-64
tree and nothing leaks into the image's own programs: no
``LD_LIBRARY_PATH``, no ``PYTHONHOME`` in anyone's environment. Python
finds its standard library next to itself (its ``sys.prefix`` is the
runtime folder). The initramfs starts the guest init with this
interpreter when the folder exists, else with ``/usr/bin/python3``; the
init and the agent then use ``sys.executable``.

What an imported image itself needs: nothing for the agent (exec with an
argv list, files, ports); ``/bin/sh`` for shell-string commands, the
start command, the ready check's ``command`` and build steps. Everything
runs as root. Size: about 40 MB.

Host tools: ``python3``, ``patchelf``, ``ldd`` (libc-bin), ``resize2fs``
(e2fsprogs), ``ip`` (iproute2).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from hangar.errors import ImageError
from hangar.images import safetree
from hangar.images.commands import Progress, require_tools, run
from hangar.images.initramfs import RUNTIME_DIR
HOST_PYTHON = Path("/usr/bin/python3")
"""The interpreter copied: Debian's, whose standard library is complete."""
TOOLS = ("resize2fs", "ip")
SKIP_STDLIB = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "distutils",
               "pydoc_data", "site-packages", "dist-packages", "__phello__"}
SKIP_DYNLOAD = re.compile(r"^(_test|_xxtest|xxlimited|_ctypes_test|_curses|_dbm|_gdbm|nis|"
                          r"ossaudiodev|readline|audioop)")
"""Extension modules left out: tests, and terminal or database modules the agent never uses
(each would bring libraries of its own)."""
LOADER = "ld-linux-x86-64.so.2"


def _host_python() -> dict[str, str]:
    exe = HOST_PYTHON.resolve()
    if not exe.is_file():
        raise ImageError(f"{HOST_PYTHON} is missing: install Debian's python3 on the host")
    out = run("python runtime", [str(exe), "-S", "-c",
                                 "import json, sys, sysconfig; print(json.dumps({"
                                 "'version': '%d.%d' % sys.version_info[:2], "
                                 "'stdlib': sysconfig.get_paths()['stdlib'], "
                                 "'dynload': sysconfig.get_config_var('DESTSHARED')}))"])
    info = json.loads(out.strip().splitlines()[-1])
    info["exe"] = str(exe)
    return info


def _which(tool: str) -> Path:
    for d in ("/usr/sbin", "/sbin", "/usr/bin", "/bin"):
        p = Path(d) / tool
        if p.is_file():
            return p
    raise ImageError(f"host tool {tool} is missing (install e2fsprogs and iproute2)")


def _libraries(elves: list[Path]) -> set[Path]:
    """Every shared library (and the loader) the ELF files ``elves`` need, by ``ldd``."""
    found: set[Path] = set()
    for elf in elves:
        out = run("ldd", ["ldd", str(elf)], timeout=60)
        for line in out.splitlines():
            line = line.strip()
            if "not found" in line:
                raise ImageError(f"{elf} needs a library the host lacks: {line}")
            m = re.match(r"\S+ => (/\S+)", line) or re.match(r"(/\S+) \(0x", line)
            if m:
                found.add(Path(m.group(1)))
    return found


def install_runtime(root: Path, say: Progress) -> str:
    """Copy the runtime into the tree ``root`` (replacing one there); returns its Python
    version (``"3.11"``). Raises ImageError naming a missing host tool."""
    require_tools("patchelf", "ldd")
    info = _host_python()
    version = info["version"]
    say(f"adding Hangar's guest runtime (Python {version} from the host) at {RUNTIME_DIR}")
    with tempfile.TemporaryDirectory(prefix="runtime-", dir=root.parent) as tmp:
        dest = Path(tmp) / "runtime"
        _make(dest, info)
        # into the tree through safetree: the image's links cannot send it elsewhere
        safetree.remove(root, RUNTIME_DIR)
        safetree.copy_in(dest, root, RUNTIME_DIR, 0o755)
    return version


def _make(dest: Path, info: dict[str, str]) -> None:
    """The runtime folder at ``dest`` (a host folder of our own)."""
    version = info["version"]
    bindir, libdir = dest / "bin", dest / "lib"
    bindir.mkdir(parents=True)
    libdir.mkdir()
    py = bindir / f"python{version}"
    shutil.copy2(info["exe"], py)
    os.symlink(py.name, bindir / "python3")
    stdlib = libdir / f"python{version}"
    shutil.copytree(info["stdlib"], stdlib, symlinks=True,
                    ignore=lambda d, names: [n for n in names if n in SKIP_STDLIB
                                             or n.startswith("config-")
                                             or n == "EXTERNALLY-MANAGED"])
    dynload = stdlib / "lib-dynload"
    if Path(info["dynload"]).resolve() != (Path(info["stdlib"]) / "lib-dynload").resolve():
        shutil.copytree(info["dynload"], dynload, dirs_exist_ok=True)
    for so in list(dynload.glob("*.so")):
        if SKIP_DYNLOAD.match(so.name):
            so.unlink()
    tools = [bindir / t for t in TOOLS]
    for t in TOOLS:
        shutil.copy2(_which(t), bindir / t)
    for lib in _libraries([py, *tools, *sorted(dynload.glob("*.so"))]):
        shutil.copy2(lib, libdir / lib.name)  # follows the soname link: the file itself
    if not (libdir / LOADER).is_file():
        raise ImageError(f"the host's {LOADER} was not found by ldd")
    for exe in (py, *tools):
        run("patchelf", ["patchelf", "--set-interpreter", f"{RUNTIME_DIR}/lib/{LOADER}",
                         "--force-rpath", "--set-rpath", f"{RUNTIME_DIR}/lib", str(exe)],
            timeout=60)
