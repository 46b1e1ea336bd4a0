"""E2B's template builds: the unmodified ``e2b`` SDK's ``Template`` builder against a real
server, whose builds run in real build sandboxes (``hangar.core.builds``).

The SDK is configured only by E2B's three variables. Each test builds what a user of E2B
builds (copy, run, env, workdir, user, a start command with a ready check) and then checks
the result as a user would: ``Sandbox.create(name)`` and its commands.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import threading
import time
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import SRC, Server, free_port, make_data_dir
from test_e2b_api import e2b_env, e2b_key  # noqa: F401,F811  (fixtures: the three variables)

e2b = pytest.importorskip("e2b")
from e2b import Sandbox, Template, wait_for_port  # noqa: E402
from e2b.exceptions import BuildException  # noqa: E402


def name() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture()
def context(tmp_path: Path) -> Path:
    """A build context: an app folder with a page, a script and a symlink."""
    app = tmp_path / "app"
    app.mkdir()
    (app / "hello.txt").write_text("hello from the template\n")
    (app / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (app / "run.sh").chmod(0o755)
    (app / "link.txt").symlink_to("hello.txt")
    return tmp_path


@pytest.fixture()
def api(server: Server, e2b_key: str) -> Iterator[httpx.Client]:  # noqa: F811
    with httpx.Client(base_url=server.url + "/e2b", headers={"X-API-Key": e2b_key},
                      timeout=120) as c:
        yield c


def test_a_template_built_with_the_sdk_starts_with_its_start_command_serving(
        context: Path, server: Server) -> None:
    """The user's path: build from the base image with copy, env, run, workdir and a start
    command with a ready check, then create a sandbox of it: a restore whose server is
    already up, in the template's user, folder and environment."""
    t = name()
    logs: list[str] = []
    template = (
        Template(file_context_path=str(context))
        .from_base_image()
        .copy("app", "site/")
        .set_envs({"GREETING": "hi there"})
        .run_cmd("echo \"$GREETING\" > site/greeting.txt && whoami > site/builder.txt")
        .run_cmd("id -un > /root/built-by-root", user="root")
        .set_workdir("/home/user/site")
        .set_start_cmd("python3 -m http.server 8000", wait_for_port(8000))
    )
    info = Template.build(template, t, on_build_logs=lambda e: logs.append(e.message))
    assert info.name == t
    assert any("[builder 1/" in line for line in logs), logs
    assert any(line.strip() == "ready" or "is ready" in line for line in logs), logs
    assert Template.exists(t) is True
    # its ENV may hold keys: the server keeps it sealed, as a create's envVars
    assert b"hi there" not in (server.data_dir / "builds" / "templates.json").read_bytes()

    sb = Sandbox.create(t)
    try:
        # the start command was saved running: the page answers at once
        page = sb.commands.run("python3 -c \"import urllib.request as u; print(u.urlopen("
                               "'http://127.0.0.1:8000/hello.txt', timeout=5).read().decode()"
                               ", end='')\"")
        assert page.stdout == "hello from the template\n"
        here = sb.commands.run("pwd; whoami; echo \"$GREETING\"; cat greeting.txt builder.txt;"
                               " readlink link.txt; test -x run.sh && stat -c %U:%G hello.txt")
        assert here.stdout.splitlines() == [
            "/home/user/site", "user", "hi there", "hi there", "user", "hello.txt", "user:user"]
        root = sb.commands.run("cat /root/built-by-root", user="root")
        assert root.stdout.strip() == "root"
    finally:
        sb.kill()


def test_a_dockerfile_builds_through_the_sdk(context: Path) -> None:
    """``Template.from_dockerfile``: E2B's base in ``FROM``, then COPY, ENV, RUN, WORKDIR and
    USER as a Dockerfile says them, and a start command with its ready check."""
    (context / "Dockerfile").write_text(
        "FROM e2bdev/base\n"
        "COPY app/hello.txt /srv/page/index.html\n"
        "ENV PORT=8001 MODE=docker\n"
        "RUN mkdir -p /srv/data && echo \"$MODE\" > /srv/data/mode\n"
        "USER root\n"
        "WORKDIR /srv/page\n")
    template = (Template(file_context_path=str(context))
                .from_dockerfile(str(context / "Dockerfile"))
                .set_start_cmd("python3 -m http.server $PORT", wait_for_port(8001)))
    t = name()
    Template.build(template, t)
    sb = Sandbox.create(t)
    try:
        r = sb.commands.run("whoami; pwd; cat /srv/data/mode; python3 -c \"import urllib.request"
                            " as u; print(u.urlopen('http://127.0.0.1:8001/', timeout=5).read()"
                            ".decode(), end='')\"")
        assert r.stdout.splitlines() == ["root", "/srv/page", "docker",
                                         "hello from the template"]
    finally:
        sb.kill()


def test_hangar_template_build_takes_a_dockerfile_and_the_server_builds_it(
        context: Path, server: Server) -> None:
    """The CLI's Dockerfile form: ARG, ENV, COPY with --chown, RUN (both forms), USER,
    WORKDIR, CMD and EXPOSE (the ready check), built by the server; a skipped LABEL is
    named."""
    (context / "Dockerfile").write_text(
        "# a comment\n"
        "ARG GREETING=hello\n"
        "FROM base\n"
        "LABEL maintainer=nobody\n"
        "ENV MSG=\"${GREETING} world\" \\\n"
        "    PORT=8002\n"
        "COPY --chown=user:user app /srv/app/\n"
        "RUN [\"sh\", \"-c\", \"echo $MSG > /srv/app/msg.txt\"]\n"
        "USER user\n"
        "WORKDIR /srv/app\n"
        "EXPOSE 8002/tcp\n"
        "CMD python3 -m http.server $PORT\n")
    t = name()
    env = {**os.environ, "PYTHONPATH": str(SRC), "HANGAR_URL": server.url,
           "HANGAR_API_KEY": server.key}
    r = subprocess.run([sys.executable, "-m", "hangar.cli", "template", "build", "-d",
                        str(context / "Dockerfile"), t], env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == t
    assert "skipped line 4: LABEL" in r.stderr
    sb = Sandbox.create(t)
    try:
        out = sb.commands.run("whoami; pwd; cat msg.txt; stat -c %U hello.txt; python3 -c "
                              "\"import urllib.request as u; print(u.urlopen('http://127.0.0"
                              ".1:8002/hello.txt', timeout=5).read().decode(), end='')\"")
        assert out.stdout.splitlines() == ["user", "/srv/app", "hello world", "user",
                                           "hello from the template"]
    finally:
        sb.kill()
    bad = context / "Bad.Dockerfile"
    bad.write_text("FROM ubuntu:22.04 AS one\nFROM base\n")
    r = subprocess.run([sys.executable, "-m", "hangar.cli", "template", "build", "-d",
                        str(bad), name()], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "line 2 (FROM): one FROM only" in r.stderr


def test_failing_steps_fail_the_build_with_e2bs_messages_and_leave_no_sandbox(
        server: Server) -> None:
    """A failing step fails the build with E2B's words; the event stream says which step
    and why (a step's number and instruction: never an ENV's values, a RUN's command, nor
    a guest's line that looks like a step), and the build sandbox is gone."""
    before = {s.sandbox_id for s in Sandbox.list().next_items()}
    seen: list[dict] = []
    listening = threading.Event()

    def listen() -> None:  # the live event stream, as `hangar events` reads it
        with server.client() as c, c.stream("GET", "/events",
                                             params={"kind": "template.build"}) as r:
            listening.set()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    seen.append(json.loads(line[6:]))
                    if sum(e["kind"] == "template.build.failed" for e in seen) == 2:
                        return

    reader = threading.Thread(target=listen, daemon=True)
    reader.start()
    assert listening.wait(60)
    with pytest.raises(BuildException) as exc:
        Template.build(Template().from_base_image().set_envs({"TOKEN": "tok-s3cret"})
                       .run_cmd("echo '[builder 9/9] a line like a step'").run_cmd("exit 3"),
                       name())
    assert "failed to run command 'exit 3': command failed: exit status 3" in str(exc.value)
    with pytest.raises(BuildException) as exc:
        Template.build(Template().from_base_image().run_cmd("whoami", user="root123"), name())
    assert ("failed to run command 'whoami': command failed: unauthenticated: invalid "
            "username: 'root123'") in str(exc.value)
    after = {s.sandbox_id for s in Sandbox.list().next_items()}
    assert after == before
    reader.join(60)
    kinds = [e["kind"].removeprefix("template.build.") for e in seen]
    assert kinds == ["started", "sandbox", "step", "step", "step", "failed",
                     "started", "sandbox", "step", "failed"], kinds
    steps = [{k: e["data"][k] for k in ("step", "of", "instruction")}
             for e in seen if e["kind"] == "template.build.step"]
    assert steps == [{"step": "1", "of": 3, "instruction": "ENV"},
                     {"step": "2", "of": 3, "instruction": "RUN"},
                     {"step": "3", "of": 3, "instruction": "RUN"},
                     {"step": "1", "of": 1, "instruction": "RUN"}]
    assert "tok-s3cret" not in json.dumps(seen) and "a line like" not in json.dumps(seen)
    failed = [e["data"] for e in seen if e["kind"] == "template.build.failed"]
    assert [f["step"] for f in failed] == ["3", "1"]
    assert all("reason" not in f for f in failed)  # it names commands: the status says it


def test_a_start_command_that_ends_fails_the_build_at_once_with_its_output() -> None:
    """A start command that exits before its ready check passes fails the build then (not
    after the ready command's 600 s), its output in the log."""
    logs: list[str] = []
    t0 = time.monotonic()
    with pytest.raises(BuildException) as exc:
        Template.build(Template().from_base_image()
                       .set_start_cmd("python3 servr.py", wait_for_port(8000)), name(),
                       on_build_logs=lambda e: logs.append(e.message))
    assert str(exc.value) == ("the start command 'python3 servr.py' ended (exit status 2) "
                              "before the ready command passed")
    assert any("can't open file" in line and "servr.py" in line for line in logs), logs
    assert time.monotonic() - t0 < 300


def test_a_template_the_server_lacks_is_refused_naming_it_and_leaves_no_template() -> None:
    """(A registry's image, ``from_image``, is tests/test_e2b_registry.py's.)"""
    t = name()
    with pytest.raises(BuildException) as exc:
        Template.build(Template().from_template("python:3.12"), t)
    assert str(exc.value) == ("400: fromTemplate: 'python:3.12' is not an image or a template "
                              "of this server (a registry's image is fromImage)")
    assert Template.exists(t) is False


def _tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path, data in files.items():
            info = tarfile.TarInfo(path)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_an_upload_needs_its_own_token_and_a_build_checks_it_against_its_hash(
        api: httpx.Client) -> None:
    t = name()
    r = api.post("/v3/templates", json={"name": t})
    assert r.status_code == 202, r.text
    build = r.json()["buildID"]
    digest = hashlib.sha256(b"not what the SDK would hash").hexdigest()
    r = api.get(f"/templates/{t}/files/{digest}")
    assert r.status_code == 201, r.text
    link = r.json()
    assert set(link) == {"present", "url"} and link["present"] is False
    url = httpx.URL(link["url"])
    signature = url.params["signature"]
    assert api.headers["X-API-Key"] not in link["url"]
    body = _tar({"app/a.txt": b"a\n"})
    with httpx.Client(timeout=60) as anon:
        assert anon.put(url.copy_remove_param("signature"), content=body).status_code == 401
        forged = url.copy_set_param("signature", signature[:-2] + "00")
        assert anon.put(forged, content=body).status_code == 401
        other = httpx.URL(api.get(f"/templates/{t}/files/{'0' * 64}").json()["url"])
        theirs = url.copy_set_param("signature", other.params["signature"])
        assert anon.put(theirs, content=body).status_code == 401
        assert anon.put(url, content=body).status_code == 204
    assert api.get(f"/templates/{t}/files/{digest}").json() == {"present": True}
    steps = [{"type": "COPY", "args": ["app", "app", "", ""], "filesHash": digest,
              "force": False}]
    r = api.post(f"/v2/templates/{t}/builds/{build}", json={"fromImage": "e2bdev/base",
                                                             "steps": steps, "force": False})
    assert r.status_code == 202, r.text
    status = _wait(api, t, build)
    assert status["status"] == "error"
    assert status["reason"]["message"] == (
        "the upload for COPY app app does not match its hash (an e2b SDK before 2.63 hashes "
        "a folder's size on disk, which no archive carries: with a folder other than 4096 "
        "bytes, upgrade the e2b package)")
    assert status["reason"]["step"] == "1"
    assert api.post(f"/v2/templates/{t}/builds/{build}",
                    json={"fromImage": "e2bdev/base"}).status_code == 409
    assert api.delete(f"/templates/{t}").status_code == 204
    assert api.get(f"/templates/{t}/files/{digest}").status_code == 404


def _wait(api: httpx.Client, t: str, build: str, timeout_s: float = 600) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        r = api.get(f"/templates/{t}/builds/{build}/status")
        assert r.status_code == 200, r.text
        if r.json()["status"] in ("ready", "error"):
            return r.json()
        assert time.monotonic() < deadline, r.json()
        time.sleep(0.5)


def test_builds_of_one_template_run_one_at_a_time_reuse_unchanged_ones_and_keep_tags(
        api: httpx.Client) -> None:
    """One build of a template runs at a time; an unchanged rebuild reuses the snapshot;
    tags point at builds; a removed template is gone for creates too."""
    t = name()
    first = api.post("/v3/templates", json={"name": t}).json()["buildID"]
    second = api.post("/v3/templates", json={"name": f"{t}:v2"}).json()["buildID"]
    spec = {"fromImage": "e2bdev/base", "steps": [
        {"type": "RUN", "args": ["sleep 2; echo one > one.txt"], "force": False}]}
    assert api.post(f"/v2/templates/{t}/builds/{first}", json=spec).status_code == 202
    r = api.post(f"/v2/templates/{t}/builds/{second}", json=spec)
    assert r.status_code == 409, r.text
    assert "is running" in r.json()["message"]
    assert _wait(api, t, first)["status"] == "ready"

    again = api.post("/v3/templates", json={"name": t, "tags": ["v2"]}).json()["buildID"]
    assert api.post(f"/v2/templates/{t}/builds/{again}", json=spec).status_code == 202
    done = _wait(api, t, again)
    assert done["status"] == "ready"
    assert any("CACHED" in e["message"] for e in done["logEntries"]), done
    tags = {x["tag"]: x["buildID"] for x in api.get(f"/templates/{t}/tags").json()}
    assert tags == {"default": first, "v2": again}
    assert api.get(f"/templates/aliases/{t}:v2").json() == {"templateID": t, "public": False}
    assert api.get(f"/templates/aliases/{t}:v9").status_code == 404  # Template.exists: False
    r = api.post("/templates/tags", json={"target": f"{t}:v2", "tags": ["prod"]})
    assert r.status_code == 201 and r.json() == {"tags": ["prod"], "buildID": again}
    many = [f"t{i}" for i in range(64)]
    assert api.post("/templates/tags", json={"target": f"{t}:v2", "tags": many}).status_code \
        == 201
    r = api.post("/templates/tags", json={"target": f"{t}:v2",
                                          "tags": [f"u{i}" for i in range(64)]})
    assert (r.status_code, r.json()["message"]) == (
        400, "tags: a template has at most 100 tags")
    r = api.request("DELETE", "/templates/tags", json={"name": t, "tags": many})
    assert r.status_code == 204

    sb = Sandbox.create(f"{t}:prod")
    try:
        assert sb.commands.run("cat one.txt").stdout == "one\n"
    finally:
        sb.kill()
    assert api.delete(f"/templates/{t}").status_code == 204
    assert Template.exists(t) is False
    assert api.post("/sandboxes", json={"templateID": t}).status_code == 404


def test_a_slow_step_is_a_layer_that_later_builds_start_from(api: httpx.Client,
                                                              server: Server) -> None:
    """Per-step cache: a step that took ``LAYER_MIN_S`` (5 s) or more is kept as a layer;
    a build whose steps up to it are unchanged starts from it (its work is there, it is
    not run again) and runs only the rest; ``force`` on that step (E2B's ``skip_cache``)
    runs it again; removing the template removes its layers."""
    t = name()

    def snapshots() -> set[str]:
        with httpx.Client(base_url=server.url, headers={"X-API-Key": server.key},
                          timeout=60) as c:
            return {x["id"] for x in c.get("/snapshots").json()["snapshots"]}

    before = snapshots()

    def build(steps: list[dict[str, object]]) -> dict[str, object]:
        b = api.post("/v3/templates", json={"name": t}).json()["buildID"]
        spec = {"fromImage": "e2bdev/base", "steps": steps}
        assert api.post(f"/v2/templates/{t}/builds/{b}", json=spec).status_code == 202
        done = _wait(api, t, b)
        assert done["status"] == "ready", done
        return done

    slow = {"type": "RUN", "args": ["sleep 6; date +%s%N >> slow.txt"], "force": False}
    first = build([slow, {"type": "RUN", "args": ["echo a > fast.txt"], "force": False}])
    said = [e["message"] for e in first["logEntries"]]
    assert any(m.startswith("[builder] step 1 took ") and m.endswith("kept as a layer")
               for m in said), said
    second = build([slow, {"type": "RUN", "args": ["echo b > fast.txt"], "force": False}])
    said = [e["message"] for e in second["logEntries"]]
    assert "CACHED: steps 1-1 are a layer of an earlier build; the build sandbox starts " \
           "from it" in said, said
    assert not any(m.startswith("[builder 1/2]") for m in said), said
    sb = Sandbox.create(t)
    try:
        assert sb.commands.run("wc -l < slow.txt; cat fast.txt").stdout == "1\nb\n"
    finally:
        sb.kill()
    third = build([{**slow, "force": True},
                   {"type": "RUN", "args": ["echo c > fast.txt"], "force": False}])
    said = [e["message"] for e in third["logEntries"]]
    assert not any(m.startswith("CACHED") for m in said) and "[builder 1/2] RUN sleep 6; " \
        "date +%s%N >> slow.txt" in said, said
    assert api.delete(f"/templates/{t}").status_code == 204
    assert snapshots() - before == set()  # its builds' and its layers' snapshots are gone


def test_the_templates_a_server_holds_are_capped(base_image: Path) -> None:
    """HANGAR_BUILD_TEMPLATES_MAX: a new template past it is a 429 naming the cap; a new
    build of a template it holds is not one."""
    srv = Server(make_data_dir(base_image), free_port(),
                 extra_env={"HANGAR_BUILD_TEMPLATES_MAX": "2"})
    srv.start()
    try:
        with httpx.Client(base_url=srv.url + "/e2b", headers={"X-API-Key": srv.key},
                          timeout=60) as c:
            assert c.post("/v3/templates", json={"name": "one"}).status_code == 202
            assert c.post("/v3/templates", json={"name": "two"}).status_code == 202
            r = c.post("/v3/templates", json={"name": "three"})
            assert (r.status_code, r.json()["message"]) == (
                429, "this server holds 2 templates built through E2B's API "
                     "(HANGAR_BUILD_TEMPLATES_MAX); remove one first")
            assert c.post("/v3/templates", json={"name": "two:v2"}).status_code == 202
    finally:
        srv.kill()
        shutil.rmtree(srv.data_dir, ignore_errors=True)


def test_an_upload_declared_over_the_bound_is_refused_before_its_body(
        api: httpx.Client, server: Server) -> None:
    """A Content-Length past the bound (1 GiB) is answered 413 from the head alone; the
    server keeps nothing."""
    t = name()
    assert api.post("/v3/templates", json={"name": t}).status_code == 202
    digest = "1" * 64
    link = api.get(f"/templates/{t}/files/{digest}").json()
    path = httpx.URL(link["url"]).raw_path.decode()
    host, port = httpx.URL(server.url).host, httpx.URL(server.url).port
    head = (f"PUT {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {(1 << 30) + 1}\r\n"
            "\r\n")
    with socket.create_connection((host, port), timeout=60) as sock:
        sock.sendall(head.encode())
        answer = sock.recv(65536).decode("latin-1")
    assert answer.startswith("HTTP/1.1 413 "), answer[:200]
    assert api.get(f"/templates/{t}/files/{digest}").json()["present"] is False
    assert api.delete(f"/templates/{t}").status_code == 204


def _bomb(kind: bytes, size: int) -> bytes:
    """A gzip'd tar whose first member is an extended header (``kind``: pax ``x``, GNU
    long name ``L``) declaring ``size`` bytes: zeros, so it compresses ~1000 to 1."""
    info = tarfile.TarInfo("h")
    info.size = size
    head = bytearray(info.tobuf(format=tarfile.USTAR_FORMAT))
    head[156:157] = kind
    head[148:156] = b" " * 8  # the checksum, over the header with the new type
    head[148:156] = b"%06o\0 " % sum(head)
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    out = [z.compress(bytes(head))]
    block = bytes(1 << 20)
    for _ in range(size >> 20):
        out.append(z.compress(block))
    return b"".join(out) + z.flush()


def _peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def test_hostile_archives_fail_their_check_at_once_and_in_bounded_memory(
        api: httpx.Client, server: Server) -> None:
    """A ~0.5 MB upload whose tar header declares a 512 MiB pax header (or GNU long name):
    Python's tarfile would read it whole into the server's memory; the check refuses it
    from its size, the server's peak memory does not move, and the upload is removed (the
    SDK uploads again). A step's filesHash that is not a SHA-256 is a 400: it never names
    another file (a failed check removes the file it names)."""
    assert server.proc is not None
    t = name()
    build = api.post("/v3/templates", json={"name": t}).json()["buildID"]
    before = _peak_rss_kib(server.proc.pid)
    for kind, digest in ((b"x", "a" * 64), (b"L", "b" * 64)):
        link = api.get(f"/templates/{t}/files/{digest}").json()["url"]
        assert httpx.put(link, content=_bomb(kind, 512 << 20), timeout=60).status_code == 204
    steps = [{"type": "COPY", "args": [src, "/x"], "filesHash": d}
             for src, d in (("a", "a" * 64), ("b", "b" * 64))]
    bad = [{"type": "COPY", "args": ["a", "/x"], "filesHash": "../../templates.json"}]
    r = api.post(f"/v2/templates/{t}/builds/{build}", json={"fromImage": "e2bdev/base",
                                                             "steps": bad})
    assert r.status_code == 400 and "not a SHA-256" in r.json()["message"], r.text
    assert (server.data_dir / "builds" / "templates.json").is_file()
    started = time.monotonic()
    r = api.post(f"/v2/templates/{t}/builds/{build}", json={"fromImage": "e2bdev/base",
                                                             "steps": steps})
    assert r.status_code == 202, r.text
    status = _wait(api, t, build, timeout_s=60)
    assert time.monotonic() - started < 30
    assert status["reason"] == {"message": "the upload for COPY a /x is not a tar archive: an "
                                "extended header of 536870912 bytes (at most 65536)",
                                "step": "1"}, status
    assert _peak_rss_kib(server.proc.pid) - before < 128 << 10
    assert api.get(f"/templates/{t}/files/{'a' * 64}").json()["present"] is False
    assert api.delete(f"/templates/{t}").status_code == 204


def test_an_upload_never_replaces_a_stored_archive_nor_outlives_its_template(
        api: httpx.Client, server: Server) -> None:
    """A second upload to a link (valid for an hour) leaves the stored archive as it was: a
    build checks an archive, then places it, and nothing may swap it in between. An upload
    whose template is removed meanwhile is a 404 and leaves nothing."""
    t = name()
    assert api.post("/v3/templates", json={"name": t}).status_code == 202
    digest = "c" * 64
    link = api.get(f"/templates/{t}/files/{digest}").json()["url"]
    assert httpx.put(link, content=b"first", timeout=60).status_code == 204
    assert httpx.put(link, content=b"second", timeout=60).status_code == 204
    assert (server.data_dir / "builds" / "files" / t / digest).read_bytes() == b"first"

    other = "d" * 64
    link = api.get(f"/templates/{t}/files/{other}").json()["url"]
    answer: list[httpx.Response] = []

    def body() -> Iterator[bytes]:
        for _ in range(10):
            yield bytes(65536)
            time.sleep(0.2)

    def upload() -> None:
        answer.append(httpx.put(link, content=body(), timeout=60))

    sender = threading.Thread(target=upload)
    sender.start()
    time.sleep(0.6)
    assert api.delete(f"/templates/{t}").status_code == 204
    sender.join(60)
    assert answer[0].status_code == 404, answer[0].text
    assert not (server.data_dir / "builds" / "files" / t).exists()


def test_builds_never_started_count_toward_the_records_a_template_keeps(
        api: httpx.Client, server: Server) -> None:
    """``POST /v3/templates`` makes a waiting build each time: a template keeps 50 records
    (``BUILDS_KEPT``), the oldest never started forgotten, so a client cannot grow the
    registry, which every change rewrites, without end."""
    t = name()
    made = [api.post("/v3/templates", json={"name": t}).json()["buildID"] for _ in range(55)]
    registry = json.loads((server.data_dir / "builds" / "templates.json").read_bytes())
    assert set(registry["templates"][t]["builds"]) == set(made[5:])
    r = api.post(f"/v2/templates/{t}/builds/{made[0]}", json={"fromImage": "e2bdev/base"})
    assert r.status_code == 404, r.text
    assert api.delete(f"/templates/{t}").status_code == 204


def test_the_cli_never_copies_files_through_a_symlinked_folder_out_of_its_context(
        context: Path, server: Server, tmp_path: Path) -> None:
    """A Dockerfile's ``COPY`` reaches no file outside its build context through a symlink
    to a folder (as Docker refuses): the CLI says so and uploads nothing."""
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (outside / "id_rsa").write_text("not for the template\n")
    (context / "out").symlink_to(outside)
    (context / "Dockerfile").write_text("FROM base\nCOPY out/id_rsa /tmp/\n")
    env = {**os.environ, "PYTHONPATH": str(SRC), "HANGAR_URL": server.url,
           "HANGAR_API_KEY": server.key}
    t = name()
    r = subprocess.run([sys.executable, "-m", "hangar.cli", "template", "build", "-d",
                        str(context / "Dockerfile"), t], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1
    assert "COPY out/id_rsa /tmp/: 'out/id_rsa' names files outside the build context" \
        in r.stderr, r.stderr
    assert not (server.data_dir / "builds" / "files" / t).exists()
