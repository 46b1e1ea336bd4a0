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
import socket
import subprocess
import sys
import tarfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import SRC, Server
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
    and why, and the build sandbox is gone."""
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
        Template.build(Template().from_base_image().run_cmd("echo before").run_cmd("exit 3"),
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
    assert kinds == ["started", "sandbox", "step", "step", "failed",
                     "started", "sandbox", "step", "failed"], kinds
    failed = [e for e in seen if e["kind"] == "template.build.failed"]
    assert failed[0]["data"]["step"] == "2" and "exit status 3" in failed[0]["data"]["reason"]
    assert failed[1]["data"]["step"] == "1"
    assert "invalid username" in failed[1]["data"]["reason"]


def test_an_image_from_a_registry_is_refused_naming_it() -> None:
    with pytest.raises(BuildException) as exc:
        Template.build(Template().from_image("ubuntu:22.04").run_cmd("true"), name())
    assert "'ubuntu:22.04'" in str(exc.value) and "registry" in str(exc.value)


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
    assert status["reason"]["message"] == "the upload for COPY app app does not match its hash"
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
    r = api.post("/templates/tags", json={"target": f"{t}:v2", "tags": ["prod"]})
    assert r.status_code == 201 and r.json() == {"tags": ["prod"], "buildID": again}

    sb = Sandbox.create(f"{t}:prod")
    try:
        assert sb.commands.run("cat one.txt").stdout == "one\n"
    finally:
        sb.kill()
    assert api.delete(f"/templates/{t}").status_code == 204
    assert Template.exists(t) is False
    assert api.post("/sandboxes", json={"templateID": t}).status_code == 404


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
