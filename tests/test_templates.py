"""Templates: a TOML file and an OCI archive become images; sandboxes are made from them.

The builds go into the shared image cache (its .deb caches make the apt step quick)
under names of this test run's own (``t-<pid>-...``), never touching ``base``,
``desktop`` or ``dev``; they are removed when the module ends. One server of this
module's own keeps a warm pool of the Debian template.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import SHARED, SRC, Server, own_server, vmm_pids
from oci_support import busybox_rootfs, docker_archive

from hangar.errors import ImageError, InvalidRequest
from hangar.images import rootfs
from hangar.images.commands import inside
from hangar.images.template_builder import build_template, remove_template
from hangar.images.template_file import load_template, parse_template
from hangar.layout import Layout

NAME = f"t-{os.getpid()}"
"""This run's Debian template; ``NAME-child`` and ``NAME-oci`` are its others."""
TEMPLATE = """
name = "{name}"
base = "base"
description = "a test template"
packages = ["tree"]
env = {{ GREETING = "hello from the template" }}
steps = [
    "tree --version > /etc/built-by-step.txt",
    "echo \\"$GREETING at build\\" >> /etc/built-by-step.txt",
]
workdir = "/srv"
start = "python3 -m http.server 8000"

[[files]]
src = "hello.txt"
dest = "/srv/hello.txt"

[[files]]
src = "site"
dest = "/srv/site"

[ready]
port = 8000
timeout = 120
"""


def hangar_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HANGAR_DATA_DIR": str(SHARED), "PYTHONPATH": str(SRC),
           "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "hangar.cli", *args], env=env,
                          capture_output=True, text=True, timeout=1200)


def builds_of(name: str) -> set[str]:
    return {p.name for p in (SHARED / "images").glob(f"{name}-*")
            if p.name.rsplit("-", 1)[0] == name}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("template")
    (d / "hello.txt").write_text("a file from the template\n")
    (d / "site").mkdir()
    (d / "site" / "index.html").write_text("<p>site</p>\n")
    (d / "site" / "run.sh").write_text("#!/bin/sh\necho run\n")
    (d / "site" / "run.sh").chmod(0o755)
    (d / "t.toml").write_text(TEMPLATE.format(name=NAME))
    return d


@pytest.fixture(scope="module")
def built(base_image: Path, folder: Path) -> Iterator[dict[str, Any]]:
    """The Debian template, built with the CLI; every template of this run removed after."""
    try:
        first = hangar_cli("template", "build", "--no-snapshot", "-f", str(folder / "t.toml"))
        assert first.returncode == 0, first.stderr[-3000:]
        build_id, build_dir = first.stdout.split()
        yield {"id": build_id, "dir": Path(build_dir), "stderr": first.stderr}
    finally:
        for name in (f"{NAME}-child", f"{NAME}-oci", NAME):
            try:
                remove_template(Layout(SHARED), name, set())
            except Exception:
                pass
            for left in builds_of(name):  # a build a failed test left unlinked
                shutil.rmtree(SHARED / "images" / left, ignore_errors=True)
            Layout(SHARED).image_lock(name).unlink(missing_ok=True)  # this run's name alone


@pytest.fixture(scope="module")
def server(built: dict[str, Any]) -> Iterator[Server]:
    with own_server(built["dir"], {"HANGAR_POOL_TEMPLATES": f"{NAME}=1"}) as srv:
        yield srv


def sh(c: httpx.Client, sid: str, command: str) -> dict[str, Any]:
    r = c.post(f"/sandboxes/{sid}/exec", json={"command": command, "timeout": 30})
    assert r.status_code == 200, r.text
    return r.json()


# -- the file, without VMs ---------------------------------------------------------------------


@pytest.mark.parametrize("text, field", [
    ('base = "base"', "name"),
    ('name = "Bad_Name"\nbase = "base"', "name"),
    ('name = "base"\nbase = "base"', "name"),
    ('name = "x"', "base"),
    ('name = "x"\nbase = "base"\noci = "a.tar"', "base"),
    ('name = "x"\noci = "missing.tar"', "oci"),
    ('name = "x"\nbase = "base"\npackages = ["ok", "; rm -rf /"]', "packages"),
    ('name = "x"\nbase = "base"\nenv = { "A=B" = "1" }', "env"),
    ('name = "x"\nbase = "base"\nsteps = "not a list"', "steps"),
    ('name = "x"\nbase = "base"\nworkdir = "relative"', "workdir"),
    ('name = "x"\nbase = "base"\n[[files]]\ndest = "/a"', "src"),
    ('name = "x"\nbase = "base"\n[[files]]\nsrc = "nope"\ndest = "/a"', "src"),
    ('name = "x"\nbase = "base"\n[[files]]\ncontent = "a"\ndest = "/../etc/x"', "dest"),
    ('name = "x"\nbase = "base"\n[[files]]\ncontent = "a"\ndest = "/a"\nmode = "999"', "mode"),
    ('name = "x"\nbase = "base"\n[ready]\nport = 70000', "port"),
    ('name = "x"\nbase = "base"\n[ready]\ntimeout = 5', "port"),
    ('name = "x"\nbase = "base"\nvcpus = 0', "vcpus"),
    ('name = "x"\nbase = "base"\nsurprise = 1', "surprise"),
    ('name = "x"\nbase = "base"\nnetwork = "yes"', "network"),
])
def test_template_file_mistakes_name_the_field(tmp_path: Path, text: str, field: str) -> None:
    (tmp_path / "t.toml").write_text(text)
    with pytest.raises(InvalidRequest) as e:
        load_template(tmp_path / "t.toml")
    assert f": {field}:" in e.value.message and e.value.context.get("field") == field, \
        e.value.message
    assert str(tmp_path / "t.toml") in e.value.message


def test_not_toml_and_missing_files_are_clear(tmp_path: Path) -> None:
    (tmp_path / "t.toml").write_text("name = [")
    with pytest.raises(InvalidRequest, match="not valid TOML"):
        load_template(tmp_path / "t.toml")
    with pytest.raises(InvalidRequest, match="cannot read"):
        load_template(tmp_path / "none.toml")


def test_digest_follows_every_input(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("one")
    data = {"name": "x", "base": "base", "files": [{"src": "f", "dest": "/f"}]}
    t = parse_template(data, tmp_path)
    d = t.digest("base-000")
    assert d == parse_template(data, tmp_path).digest("base-000")
    assert d != t.digest("base-001")  # another base build
    assert d != parse_template({**data, "start": "x"}, tmp_path).digest("base-000")
    assert d != parse_template({**data, "env": {"A": "1"}}, tmp_path).digest("base-000")
    assert d != parse_template({**data, "network": True}, tmp_path).digest("base-000")
    (tmp_path / "f").write_text("two")  # a copied file's content
    assert d != parse_template(data, tmp_path).digest("base-000")


def test_writes_into_a_tree_never_leave_it(tmp_path: Path) -> None:
    """An image's links (absolute, relative, looping) cannot send a write onto the host."""
    host, host_home = tmp_path / "host", tmp_path / "home"
    host.mkdir()
    host_home.mkdir()
    root = tmp_path / "root"
    root.mkdir()
    (root / "etc").symlink_to(host)                      # absolute, to a host folder
    (root / "usr").symlink_to("../../host")              # relative, climbing out
    (root / "root").symlink_to(host_home)                # /root, to the host's
    (root / "loop").symlink_to("loop")
    rootfs.guest_setup(root)
    rootfs.put_file(root, "/usr/local/bin/tool", "x")
    assert list(host.iterdir()) == [] and list(host_home.iterdir()) == []
    assert (root / str(host).lstrip("/") / "hostname").read_text() == "hangar\n"
    assert (root / "host" / "local" / "bin" / "tool").read_text() == "x"
    assert (root / str(host_home).lstrip("/")).is_dir()
    with pytest.raises(ImageError, match="too many symbolic links"):
        inside(root, "/loop/x")


def test_oci_layout_folder_is_read(tmp_path: Path) -> None:
    """An OCI image layout (as skopeo writes it) unpacks to the tree, with the image's env."""
    from hangar.images import oci

    busybox_rootfs(tmp_path / "root", {"/etc/marker": "layout\n"})
    docker_archive(tmp_path / "root", tmp_path / "tiny.tar", env=["PATH=/bin", "A=1"],
                   cmd=["/bin/sh"], workdir="/work")
    subprocess.run(["skopeo", "--insecure-policy", "copy", "--quiet",
                    f"docker-archive:{tmp_path / 'tiny.tar'}", f"oci:{tmp_path / 'layout'}:v1"],
                   check=True, timeout=120)
    assert oci.source(tmp_path / "layout") == f"oci:{tmp_path / 'layout'}"
    work = tmp_path / "work"
    work.mkdir()
    image = oci.unpack(tmp_path / "layout", work, lambda _m: None)
    assert (image.rootfs / "etc" / "marker").read_text() == "layout\n"
    assert (image.rootfs / "bin" / "busybox").is_file()
    assert image.env == {"PATH": "/bin", "A": "1"}
    assert image.command == ["/bin/sh"] and image.workdir == "/work"
    with pytest.raises(InvalidRequest, match="neither"):
        (tmp_path / "junk.tar").write_bytes(b"")
        subprocess.run(["tar", "cf", str(tmp_path / "junk.tar"), "-C", str(tmp_path), "work"],
                       check=True)
        oci.source(tmp_path / "junk.tar")


# -- real builds and VMs -----------------------------------------------------------------------


@pytest.mark.vm
def test_build_reports_progress_and_a_second_build_is_reused(built: dict[str, Any],
                                                             folder: Path) -> None:
    assert built["id"].startswith(f"{NAME}-") and built["dir"].is_dir()
    assert "apt-get install tree" in built["stderr"] and "step 2/2" in built["stderr"]
    manifest = json.loads((built["dir"] / "manifest.json").read_text())
    assert manifest["template"]["start"] == "python3 -m http.server 8000"
    assert manifest["base"] == os.readlink(SHARED / "images" / "base")  # base untouched
    before = builds_of(NAME)
    again = hangar_cli("template", "build", "--no-snapshot", "-f", str(folder / "t.toml"))
    assert again.returncode == 0, again.stderr
    assert again.stdout.split()[0] == built["id"]
    assert "unchanged" in again.stderr and builds_of(NAME) == before  # nothing was built
    listed = hangar_cli("template", "ls")
    assert NAME in listed.stdout and built["id"] in listed.stdout


@pytest.mark.vm
def test_oci_archive_becomes_a_bootable_template(server: Server, tmp_path: Path) -> None:
    """A root filesystem with nothing but a static busybox: no C library, no Python."""
    busybox_rootfs(tmp_path / "root", {"/etc/os-release": 'NAME="tiny"\n',
                                       "/www/index.html": "<p>busybox httpd</p>\n"})
    docker_archive(tmp_path / "root", tmp_path / "tiny.tar",
                   env=["PATH=/bin", "GREETING=from the image"], cmd=["/bin/sh"])
    (tmp_path / "oci.toml").write_text(
        f'name = "{NAME}-oci"\noci = "tiny.tar"\nenv = {{ EXTRA = "from the template" }}\n'
        'start = "httpd -f -p 8080 -h /www"\n[ready]\nport = 8080\ntimeout = 120\n')
    lines: list[str] = []
    image = build_template(Layout(SHARED), load_template(tmp_path / "oci.toml"),
                           progress=lines.append)
    assert any("guest runtime" in ln for ln in lines)
    server.refresh_images()
    with server.client() as c:
        r = c.post("/sandboxes", json={"image": f"{NAME}-oci"})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        assert r.json()["image_id"] == image.id
        out = sh(c, sid, "cat /etc/os-release; echo $GREETING; echo $EXTRA; "
                         "command -v python3 || echo no-python; df -k / | tail -n1")
        lines = out["stdout"].splitlines()
        assert lines[:4] == ['NAME="tiny"', "from the image", "from the template", "no-python"]
        assert int(lines[4].split()[1]) > 1 << 20  # the root grew to the 2 GiB disk
        r = c.post(f"/sandboxes/{sid}/exec", json={"command": "busybox",
                                                   "args": ["echo", "argv works"]})
        assert r.json()["stdout"] == "argv works\n"
        # the start command runs and was ready before the create answered
        c.post(f"/sandboxes/{sid}/ports", json={"port": 8080}).raise_for_status()
        r = c.get(f"/sandboxes/{sid}/ports/8080/index.html")
        assert r.status_code == 200 and r.text == "<p>busybox httpd</p>\n"
        c.delete(f"/sandboxes/{sid}")


@pytest.mark.vm
def test_a_ready_check_that_fails_fails_the_create_and_leaves_nothing(
        server: Server, built: dict[str, Any], tmp_path: Path) -> None:
    """A template on a template (its tree, env and files come along) whose start command
    dies: the create answers 502 at once (not retryable, not the ready timeout) quoting the
    start log, and nothing of it is left."""
    (tmp_path / "child.toml").write_text(
        f'name = "{NAME}-child"\nbase = "{NAME}"\n'
        'start = "echo child starting; exit 3"\n[ready]\nport = 9\ntimeout = 5\n')
    image = build_template(Layout(SHARED), load_template(tmp_path / "child.toml"))
    server.refresh_images()
    manifest = json.loads((image.dir / "manifest.json").read_text())
    assert manifest["base"] == built["id"]
    assert manifest["template"]["env"] == {"GREETING": "hello from the template"}
    with server.client() as c:
        before = {s["id"] for s in c.get("/sandboxes").json()["sandboxes"]}
        vmms = len(vmm_pids(str(server.data_dir)))
        r = c.post("/sandboxes", json={"image": f"{NAME}-child"})
        assert r.status_code == 502, r.text
        err = r.json()["error"]
        assert err["code"] == "guest_error"
        assert "start command exited with status 3" in err["message"]
        assert "child starting" in err["message"]
        assert {s["id"] for s in c.get("/sandboxes").json()["sandboxes"]} == before
        deadline = time.monotonic() + 30
        while len(vmm_pids(str(server.data_dir))) > vmms and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(vmm_pids(str(server.data_dir))) <= vmms


@pytest.mark.vm
def test_pool_keeps_the_template_warm_and_sandboxes_have_what_it_adds(
        server: Server, built: dict[str, Any]) -> None:
    """Last: taking the pooled VM starts a refill, which the module's end stops."""
    with server.client() as c:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            pool = c.get("/pool").json()
            if pool["ready"] >= 1:
                break
            time.sleep(0.5)
        assert pool["templates"] == {NAME: 1} and pool["ready"] >= 1, pool
        r = c.post("/sandboxes", json={"image": NAME})
        assert r.status_code == 201, r.text
        sb = r.json()
        assert sb["source"] == "pool" and sb["image_id"] == built["id"]
        sid = sb["id"]
        out = sh(c, sid, "tree --version | head -c 9; echo; cat /srv/hello.txt; "
                         "cat /etc/built-by-step.txt; echo $GREETING; /srv/site/run.sh; "
                         "cat /srv/site/index.html")
        assert out["stdout"].splitlines() == [
            "tree v2.1", "a file from the template", out["stdout"].splitlines()[2],
            "hello from the template at build", "hello from the template", "run",
            "<p>site</p>"]
        assert out["stdout"].splitlines()[2].startswith("tree v2.1")  # the step ran it
        # the start command was serving before the create answered (it ran before the pause)
        c.post(f"/sandboxes/{sid}/ports", json={"port": 8000}).raise_for_status()
        r = c.get(f"/sandboxes/{sid}/ports/8000/hello.txt")
        assert r.status_code == 200 and r.text == "a file from the template\n"
        assert "starting: python3 -m http.server 8000" in sh(
            c, sid, "cat /run/hangar/start.log")["stdout"]
        c.delete(f"/sandboxes/{sid}")


def test_a_live_template_build_names_its_vm_and_a_finished_one_does_not(tmp_path: Path) -> None:
    """A server that starts beside ``hangar image build`` spares the build's template VM:
    the build holds its snapshot's lock with the VM's id in it (``templates.building``),
    which the start-up sweep adds to the VMs it keeps."""
    import fcntl

    from hangar.core.templates import building

    snaps = tmp_path / "images" / "base-0123" / "template-snapshots"
    snaps.mkdir(parents=True)
    (snaps / ".oldkey.lock").write_text("tpl-aaaaaaaaaaaa")  # a finished build's: unlocked
    fd = os.open(snaps / ".newkey.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, b"tpl-0123456789ab", 0)
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert building(Layout(tmp_path)) == {"tpl-0123456789ab"}
        fcntl.flock(fd, fcntl.LOCK_UN)
        assert building(Layout(tmp_path)) == set()
    finally:
        os.close(fd)
