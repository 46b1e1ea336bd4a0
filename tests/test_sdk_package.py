"""The SDK as a package: generated from one source, typed, documented, light to install,
and the CLI built on its public surface only."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from conftest import Server

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def test_the_blocking_client_is_generated_from_the_async_one() -> None:
    r = subprocess.run([PY, "scripts/gen_sync.py", "--check"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def private_sdk_uses(source: str) -> list[str]:
    """Private SDK names a module uses: imports of ``hangar.client._x`` or of ``_names`` from
    ``hangar.client``, and any ``obj._attr`` but the module's own ``self._attr``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hangar.client"):
            if any(part.startswith("_") for part in (node.module or "").split(".")):
                found.append(f"line {node.lineno}: from {node.module}")
            found += [f"line {node.lineno}: {a.name}" for a in node.names
                      if a.name.startswith("_")]
        elif isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names
                      if a.name.startswith("hangar.client._")]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__") \
                and not (isinstance(node.value, ast.Name) and node.value.id == "self"):
            found.append(f"line {node.lineno}: .{node.attr}")
    return found


def test_the_cli_uses_only_the_public_sdk() -> None:
    assert sorted(private_sdk_uses("from hangar.client._core import x\nh._call('GET', '/')\n"
                                   "from hangar.client import _core\n")) == [
        "line 1: from hangar.client._core", "line 2: ._call", "line 3: _core"]
    for path in sorted((ROOT / "src/hangar/cli").glob("*.py")):
        assert private_sdk_uses(path.read_text()) == [], path


def test_mypy_strict_passes_on_the_sdk_and_a_typed_example(tmp_path: Path) -> None:
    r = subprocess.run(
        [PY, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path / "cache"),
         "src/hangar/client", "src/hangar/schemas", "src/hangar/errors.py",
         "src/hangar/cli/events_view.py", "examples/sdk_usage.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_reference_docs_build_without_warnings(tmp_path: Path) -> None:
    r = subprocess.run([PY, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                        "docs/reference", str(tmp_path / "html")], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    page = (tmp_path / "html" / "client.html").read_text()
    assert "exec_stream" in page and "Idempotency-Key" in page


def locked() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = version
    return pins


def test_the_lock_file_pins_every_dependency_within_its_range() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [*project["dependencies"], *(r for extra in project["optional-dependencies"].values()
                                        for r in extra)]
    pins = locked()
    for spec in reqs:
        req = Requirement(spec)
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is not in requirements.lock"
        assert req.specifier.contains(pins[name], prereleases=True), (spec, pins[name])


@pytest.mark.vm
def test_the_sdk_alone_installs_light_and_lists_sandboxes(server: Server,
                                                          tmp_path: Path) -> None:
    src = tmp_path / "hangar-src"
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns(
        "__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    venv = tmp_path / "venv"
    subprocess.run([PY, "-m", "venv", str(venv)], check=True, timeout=120)
    r = subprocess.run([str(venv / "bin/pip"), "install", "-q", "--disable-pip-version-check",
                        "-c", str(ROOT / "requirements.lock"), str(src)],
                       capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([str(venv / "bin/pip"), "list", "--format=freeze"],
                       capture_output=True, text=True, timeout=60)
    installed = {canonicalize_name(line.split("==")[0]) for line in r.stdout.splitlines()}
    assert "hangar" in installed and "httpx" in installed
    for heavy in ("fastapi", "sqlalchemy", "qemu-qmp", "uvicorn", "pyroute2", "starlette"):
        assert heavy not in installed, f"{heavy} came with the SDK"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HANGAR_URL=server.url, HANGAR_API_KEY=server.key, COLUMNS="200")
    r = subprocess.run([str(venv / "bin/hangar"), "ls"], env=env, capture_output=True,
                       text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "state" in r.stdout and "memory (MiB)" in r.stdout
    r = subprocess.run([str(venv / "bin/hangar"), "serve"], env=env, capture_output=True,
                       text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 1 and "hangar[server]" in r.stderr and "Traceback" not in r.stderr
