"""Templates built through E2B's API from an image of a registry (``from_image``): a real
registry on loopback (``registry_support``) stands in for Docker Hub through the
operator's mirror setting, a real server (split from root, as installed) pulls as root
through its helper, and the unmodified ``e2b`` SDK builds and starts the template."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import registry_support
from conftest import SHARED, SRC, Server, make_data_dir, own_server
from oci_support import busybox_rootfs, docker_archive
from test_e2b_api import e2b_env, e2b_key  # noqa: F401,F811  (fixtures: the three variables)

e2b = pytest.importorskip("e2b")
from e2b import Sandbox, Template  # noqa: E402
from e2b.exceptions import BuildException  # noqa: E402

pytestmark = pytest.mark.skipif(not registry_support.available(),
                                reason="docker-registry and skopeo are not installed")

PROGRAMS = {"/usr/bin/setpriv": "setpriv", "/usr/bin/install": "install", "/bin/dash": "sh",
            "/bin/bash": "bash"}
"""Host programs the image gets (as ``/bin/<name>``), with their libraries: util-linux's
setpriv and coreutils' install, which E2B's default user's set-up uses (Debian's busybox
has no install, and its shell runs its own setpriv applet whatever the PATH holds), dash
as the shell, and bash, which E2B's SDK runs commands with; the images users pull have
them all."""


def _tiny_tree(root: Path) -> None:
    """busybox, and ``PROGRAMS`` with the libraries they need: E2B's default user can be
    made and commands run as it."""
    busybox_rootfs(root, {"/etc/hello": "hello from the registry\n",
                          "/etc/skel/.profile": "# the image's own\n",
                          "/etc/passwd": "root:x:0:0:root:/root:/bin/sh\n",
                          "/etc/group": "root:x:0:\n"})
    for program, as_name in PROGRAMS.items():
        dest = root / "bin" / as_name
        dest.unlink(missing_ok=True)  # busybox's applet, a link to busybox itself
        shutil.copy2(program, dest)
        out = subprocess.run(["ldd", program], capture_output=True, text=True,
                             check=True).stdout
        for line in out.splitlines():
            path = line.split("=>")[-1].split("(")[0].strip()
            if path.startswith("/"):
                lib = root / path.lstrip("/")
                lib.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, lib)


@pytest.fixture(scope="module")
def local_registry(tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[registry_support.LocalRegistry]:
    """A registry holding ``library/tiny:1`` (Docker Hub's ``tiny:1`` through the mirror)."""
    folder = tmp_path_factory.mktemp("registry")
    _tiny_tree(folder / "root")
    docker_archive(folder / "root", folder / "tiny.tar", env=["PATH=/bin", "FROM_IMAGE=yes"],
                   cmd=["sh"])
    with registry_support.LocalRegistry(folder / "registry") as reg:
        reg.push(f"docker-archive:{folder / 'tiny.tar'}", "library/tiny:1")
        yield reg


@pytest.fixture(scope="module")
def server(base_image: Path, local_registry: registry_support.LocalRegistry
           ) -> Iterator[Server]:
    """A server whose Docker Hub is the local registry (``HANGAR_REGISTRY_MIRRORS``), with
    the kernel package its image builds need already in its cache (as an installed host's
    first build leaves it)."""
    d = make_data_dir(base_image)
    debs = d / "cache" / "debs"
    debs.mkdir(parents=True)
    for deb in (SHARED / "cache" / "debs").glob("linux-image-*.deb"):
        os.link(deb, debs / deb.name)
    with own_server(base_image, {
            "HANGAR_REGISTRY_MIRRORS": f"docker.io={local_registry.host}",
            "HANGAR_REGISTRY_INSECURE": local_registry.host}, data_dir=d) as srv:
        yield srv


def name() -> str:
    return f"r-{uuid.uuid4().hex[:10]}"


def test_a_template_from_a_registry_image_starts_from_that_image(server: Server,
                                                                 tmp_path: Path) -> None:
    """The user's path: ``from_image("tiny:1")``, a COPY (the image has no Python: Hangar's
    guest runtime places it), a RUN as E2B's default user, a start command; a sandbox of
    the template has the image's files and environment, runs as ``user`` in
    ``/home/user`` (with the image's own skel)."""
    (tmp_path / "app.txt").write_text("copied in\n")
    t = name()
    template = (Template(file_context_path=str(tmp_path)).from_image("tiny:1")
                .copy("app.txt", "app.txt")
                .run_cmd("cat /etc/hello > made.txt && whoami >> made.txt")
                .set_start_cmd("echo started > /tmp/started; exec sleep 100000",
                               "test -f /tmp/started"))
    logs: list[str] = []
    Template.build(template, t, cpu_count=1, memory_mb=512,
                   on_build_logs=lambda e: logs.append(e.message))
    assert any("pulling docker.io/library/tiny:1 (1 layers" in ln for ln in logs), logs
    sbx = Sandbox.create(t, timeout=120)
    try:
        r = sbx.commands.run("cat made.txt; pwd; echo $FROM_IMAGE; cat /tmp/started; "
                             "cat .profile app.txt; stat -c %U app.txt")
        assert r.stdout == ("hello from the registry\nuser\n/home/user\nyes\nstarted\n"
                            "# the image's own\ncopied in\nuser\n")
    finally:
        sbx.kill()


def test_the_cli_builds_a_dockerfile_from_a_registry_image(server: Server,
                                                           tmp_path: Path) -> None:
    """``hangar template build -d``: ``FROM tiny:1`` names no template of the server, so
    it is the registry's image; the steps run as root in ``/`` as Docker's do."""
    (tmp_path / "Dockerfile").write_text("FROM tiny:1\nRUN cp /etc/hello /made.txt\n")
    t = name()
    env = {**os.environ, "PYTHONPATH": str(SRC), "HANGAR_URL": server.url,
           "HANGAR_API_KEY": server.key}
    r = subprocess.run([sys.executable, "-m", "hangar.cli", "template", "build", "-d",
                        str(tmp_path / "Dockerfile"), t], env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    said = " ".join(r.stderr.split())  # the CLI wraps its lines
    assert "FROM registry:tiny:1: starting the build sandbox" in said
    assert "[registry] pulling docker.io/library/tiny:1 (1 layers" in said
    sbx = Sandbox.create(t, timeout=120)
    try:
        assert sbx.commands.run("cat /made.txt").stdout == "hello from the registry\n"
    finally:
        sbx.kill()


def test_an_image_the_registry_lacks_fails_the_build_naming_the_registry(
        server: Server, local_registry: registry_support.LocalRegistry) -> None:
    with pytest.raises(BuildException) as e:
        Template.build(Template().from_image("tiny:404").run_cmd("true"), name(),
                       cpu_count=1, memory_mb=512)
    assert (f"image docker.io/library/tiny:404 could not be pulled from docker.io (mirror "
            f"{local_registry.host}): ") in str(e.value), str(e.value)
    assert "manifest unknown" in str(e.value)


def test_a_registry_the_operator_did_not_allow_is_refused_at_once(server: Server) -> None:
    """HANGAR_REGISTRIES (default docker.io): another registry is a 400 when the build
    starts; nothing is fetched."""
    with pytest.raises(BuildException) as e:
        Template.build(Template().from_image("ghcr.io/someone/app:1"), name(),
                       cpu_count=1, memory_mb=512)
    assert ("fromImage: image ghcr.io/someone/app:1: registry ghcr.io is not one this "
            "server pulls from (HANGAR_REGISTRIES: docker.io)") in str(e.value)


def test_a_pulled_image_nothing_uses_is_collected_with_its_name(server: Server) -> None:
    """``hangar image gc``: a pulled image (``reg-*``) stays while a template built from
    it does; once the templates are removed, its build and its name go (a later build
    pulls again)."""
    import httpx
    env = {**os.environ, "PYTHONPATH": str(SRC), "HANGAR_DATA_DIR": str(server.data_dir)}

    def gc(*args: str) -> str:
        r = subprocess.run([sys.executable, "-m", "hangar.cli", "image", "gc", *args],
                           env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return " ".join(r.stdout.split())

    pulled = sorted(p.name for p in (server.data_dir / "images").glob("reg-tiny-1-*"))
    assert len(pulled) == 2, pulled  # the name and its build
    assert f"kept {pulled[1]} (pinned)" in gc("--dry-run")
    with httpx.Client(base_url=server.url + "/e2b", headers={"X-API-Key": server.key},
                      timeout=120) as c:
        for t in c.get("/templates").json():
            if t["templateID"].startswith("r-"):
                assert c.delete(f"/templates/{t['templateID']}").status_code == 204
    assert f"removed {pulled[1]}" in gc()
    assert list((server.data_dir / "images").glob("reg-tiny-1-*")) == []


@pytest.mark.parametrize(("text", "expected"), [
    ("ubuntu", "docker.io/library/ubuntu:latest"),
    ("ubuntu:22.04", "docker.io/library/ubuntu:22.04"),
    ("someone/app", "docker.io/someone/app:latest"),
    ("ghcr.io/a/b/c:v1.2", "ghcr.io/a/b/c:v1.2"),
    ("localhost:5000/x", "localhost:5000/x:latest"),
    ("python@sha256:" + "a" * 64, "docker.io/library/python@sha256:" + "a" * 64),
])
def test_references_read_as_docker_reads_them(text: str, expected: str) -> None:
    from hangar.images import registry
    assert str(registry.parse(text)) == expected


@pytest.mark.parametrize(("text", "message"), [
    ("Ubuntu", "'library/Ubuntu' is not a repository name"),
    ("ubuntu:bad tag", "'bad tag' is not a tag"),
    ("x@sha256:zz", "a digest is sha256: and 64 hex digits"),
    ("a" * 300, "an image reference is 1-255 characters"),
    ("ex_ample.com/a", "'ex_ample.com' is not a registry host"),
])
def test_bad_references_are_refused_naming_the_fault(text: str, message: str) -> None:
    from hangar.errors import InvalidRequest
    from hangar.images import registry
    with pytest.raises(InvalidRequest) as e:
        registry.parse(text)
    assert message in e.value.message


def _pull(helper: object, name: str, ref: str, timeout: float = 600) -> tuple[int, list[str]]:
    """Drive the root helper's ``image_pull`` and ``image_pull_wait`` as a split server
    does; returns the puller's exit status and output lines."""
    def ask(**req: object) -> dict:
        return helper.answer(json.dumps(req).encode(), [])  # type: ignore[attr-defined]

    assert ask(op="image_pull", name=name, ref=ref) == {"ok": True, "result": None}
    lines: list[str] = []
    offset, deadline = 0, time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = ask(op="image_pull_wait", name=name, offset=offset)["result"]
        lines += got["lines"]
        offset = got["offset"]
        if got["exit"] is not None:
            return got["exit"], lines
        time.sleep(0.5)
    raise AssertionError(f"the pull did not end: {lines[-5:]}")


@pytest.mark.skipif(os.geteuid() != 0, reason="the root helper runs as root")
def test_the_root_helper_pulls_nothing_through_a_swapped_images_folder(
        tmp_path: Path, local_registry: registry_support.LocalRegistry,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Class 1 for ``image_pull``: a compromised split server swaps ``<data>/images`` for
    a symlink to a folder of root's; the puller (root) builds nothing there and says why.
    Requests whose name or reference could name a path are refused by the table."""
    from test_root_acts import OWNER, QEMU, split_data, swap

    from hangar.engines.confine import ConfineConfig, Confinement
    from hangar.roothelper import Helper

    monkeypatch.setenv("HANGAR_REGISTRY_MIRRORS", f"docker.io={local_registry.host}")
    monkeypatch.setenv("HANGAR_REGISTRY_INSECURE", local_registry.host)
    layout, out = split_data(tmp_path)
    debs = layout.cache / "debs"
    debs.mkdir()
    for deb in (SHARED / "cache" / "debs").glob("linux-image-*.deb"):
        os.link(deb, debs / deb.name)
    helper = Helper(layout, Confinement(ConfineConfig(uid_registry=tmp_path / "uids",
                                                      cgroups="off")), OWNER, QEMU)
    try:
        for bad in ({"name": "../x", "ref": "tiny:1"}, {"name": "x", "ref": "/etc/shadow"},
                    {"name": "x", "ref": "tiny:1 --src-creds=a:b"}):
            got = helper.answer(json.dumps({"op": "image_pull", **bad}).encode(), [])
            assert got["ok"] is False and got["error"].startswith("bad request: "), got
        swap(layout.images, out.dir)
        code, lines = _pull(helper, "tiny", "tiny:1")
        assert code == 1 and lines[-1].endswith(
            "data/images: the symlink images is in a folder others may write"), lines[-3:]
        out.untouched()
    finally:
        if helper.pulls is not None:
            helper.pulls.stop_all()
