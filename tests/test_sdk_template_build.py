"""The SDK's ``build_template``: a Dockerfile built by a real server in a real build
sandbox, then a sandbox of the template made through E2B's SDK (as docs/ports-and-
templates.md says to)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from conftest import Server
from test_e2b_api import e2b_env, e2b_key  # fixtures: E2B's three variables

from hangar.client import AsyncHangar, BuildLog, DockerfileError, Hangar, TemplateBuild
from hangar.errors import InvalidRequest

e2b = pytest.importorskip("e2b")
from e2b import Sandbox  # noqa: E402

FIXTURES = (e2b_env, e2b_key)
"""Imported for pytest, which finds them by name here."""


def name() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


def test_the_sdk_builds_a_dockerfile_on_the_server(server: Server, tmp_path: Path) -> None:
    """asyncio: FROM base, one COPY (its files uploaded), one RUN; a sandbox of the
    template has the file the RUN made. Blocking: a step that fails raises InvalidRequest
    with the server's reason and the Dockerfile's line; a line not served raises
    DockerfileError, a COPY of no file InvalidRequest, before any request; the server's
    refusal (in E2B's error shape) is InvalidRequest with its message."""
    (tmp_path / "hello.txt").write_text("hello from the sdk\n")
    (tmp_path / "Dockerfile").write_text(
        "FROM base\n"
        "COPY hello.txt /srv/hello.txt\n"
        "RUN tr a-z A-Z < /srv/hello.txt > /srv/loud.txt\n")
    t = name()
    logs: list[BuildLog] = []

    async def build() -> TemplateBuild:
        async with AsyncHangar(server.url, server.key) as h:
            return await h.build_template(t, tmp_path / "Dockerfile", on_log=logs.append)

    done = asyncio.run(build())
    assert (done.name, done.skipped) == (t, ())
    said = [line.message for line in logs]
    assert "uploaded the files of COPY hello.txt /srv/hello.txt" in said, said
    sb = Sandbox.create(t)
    try:
        assert sb.commands.run("cat /srv/loud.txt").stdout == "HELLO FROM THE SDK\n"
    finally:
        sb.kill()

    with Hangar(server.url, server.key) as h:
        with pytest.raises(DockerfileError) as bad:
            h.build_template(name(), "FROM base\nRUN --mount=type=cache true\n")
        assert bad.value.message.startswith("line 2 (RUN): RUN's options (--mount=type=cache)")
        with pytest.raises(InvalidRequest) as missing:  # the context is checked first
            h.build_template(name(), "FROM base\nCOPY nothing.txt /srv/\n", context=tmp_path)
        assert missing.value.message == f"COPY nothing.txt /srv/: no file in {tmp_path} " \
            "matches 'nothing.txt'"
        with pytest.raises(InvalidRequest) as refused:  # the server's own words (E2B's shape)
            h.build_template("base", "FROM base\nRUN true\n")
        assert refused.value.message == "name: 'base' is one of Hangar's images; choose " \
            "another name"
        with pytest.raises(InvalidRequest) as failed:
            h.build_template(name(), "FROM base\nRUN true\n\nRUN exit 3\n")
    assert "failed (line 4): failed to run command 'exit 3': command failed: exit status " \
           "3" in failed.value.message, failed.value.message
    assert failed.value.context["line"] == 4
