# Generated from hangar/client/_async/templates.py by scripts/gen_sync.py: do not edit.
"""Templates built by the server from a Dockerfile: the flat client's ``build_template``.

The build goes through the server's template build routes, the flow E2B's
SDK uses (``hangar.api.e2b.builds``): a new build of the template, then
each ``COPY``'s files (a tar made and hashed by ``hangar.build_archive``)
uploaded to the signed URL the server gives unless it has them, then the
steps (``hangar.dockerfile``, shared with ``hangar template build -d``),
then the build's status and log, polled until it ends. See
docs/ports-and-templates.md. Mixed into ``AsyncHangar``; source of
``hangar/client/_sync/templates.py``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from hangar import dockerfile as _dockerfile
from hangar.build_archive import archive_hash, make_archive, matched_files
from hangar.client import _core
from hangar.client._sync._compat import file_chunks, run_blocking, sleep
from hangar.client._sync.mixin import flat_client as _client
from hangar.dockerfile import BUILD_TIMEOUT_S, BuildLog, Plan, TemplateBuild
from hangar.errors import InvalidRequest, NotFound, RequestTimeout

if TYPE_CHECKING:
    from hangar.client._sync.client import Hangar

POLL_S = 0.3
"""Seconds between two polls of a build's status that brought no new log line: the CLI's
figure since its Dockerfile form came (E2B's SDK waits 0.2 s, its
``_logs_refresh_frequency``); a build's step takes seconds under software emulation."""


class TemplateCalls:
    """The flat client's template build (mixed into ``AsyncHangar``)."""

    def build_template(self, name: str, dockerfile: str | os.PathLike[str], *,
                             context: str | os.PathLike[str] | None = None,
                             force: bool = False, vcpus: int | None = None,
                             memory_mib: int | None = None,
                             on_log: Callable[[BuildLog], None] | None = None,
                             timeout: float = BUILD_TIMEOUT_S,
                             request_timeout: float | None = None) -> TemplateBuild:
        """Build template ``name`` from a Dockerfile on the server, through E2B's build
        routes (under ``/e2b``); answers once the build is ready.

        ``dockerfile`` is a path-like (the file is read) or a ``str`` (the Dockerfile's
        text). ``COPY`` and ``ADD`` read their files from ``context`` (default: the
        Dockerfile's folder, or the current directory for text). ``force`` makes a new
        build even where the server has one of the same steps; ``vcpus`` and
        ``memory_mib`` (MiB) size the template's sandboxes. ``on_log`` is called with
        each ``BuildLog`` line as it comes (the server's, skipped instructions, uploads).
        ``timeout`` bounds the whole build, seconds; ``request_timeout`` each call (the
        uploads get ``Timeouts.upload`` of their size). What each instruction does is in
        ``hangar.dockerfile``; sandboxes of the template are created by ``name`` through
        E2B's API (``/e2b``). A call is not retried, except the reads.

        Raises DockerfileError (an ``InvalidRequest`` naming the Dockerfile's line: an
        instruction not served, a second ``FROM``); InvalidRequest (the Dockerfile cannot
        be read, a ``str`` of one word such as a file's name, a ``COPY`` names no file of
        the context or leaves it, the server refused the build or its base, or the build
        failed: its message has the server's reason and the line of the step that failed,
        its ``context`` has ``line``, ``step``, ``reason`` and ``build_id``);
        LimitExceeded (the server's cap of templates); RequestTimeout (past ``timeout``:
        the build may still end, outcome unknown).
        """
        c = _client(self)
        t0 = time.monotonic()
        plan, root = _dockerfile.read(dockerfile, context)
        t = c._t(request_timeout, c.config.timeouts.control)

        def say(level: str, message: str) -> None:
            if on_log is not None:
                on_log(BuildLog(level=level, message=message, timestamp=_dockerfile.now()))

        for skipped in plan.skipped:
            say("warn", f"skipped {skipped}")
        for s in plan.steps:  # the context's files, checked before the server is asked
            if s["type"] == "COPY":
                _matched(root, s["args"][0], s["args"][1])
        created = c._json("POST", "/e2b/v3/templates", timeout=t, retry=False,
                                json=_dockerfile.new_build_body(name, vcpus, memory_mib))
        template, build_id = created["templateID"], created["buildID"]
        steps = [dict(s) for s in plan.steps]
        for s in steps:
            if s["type"] == "COPY":
                s["filesHash"] = _copy(c, template, root, s["args"][0], s["args"][1],
                                             t, say)
        from_image = plan.from_image
        if plan.maybe_image:  # the server's template of that name, else a registry's image
            try:
                c._send("GET", f"/e2b/templates/aliases/{plan.base}", timeout=t,
                              retry=True)
                from_image = False
            except NotFound:
                from_image = True
        c._send("POST", f"/e2b/v2/templates/{template}/builds/{build_id}", timeout=t,
                      retry=False, json=_dockerfile.start_body(plan, steps, from_image, force))
        _wait(c, plan, template, build_id, t, timeout, t0, on_log)
        return TemplateBuild(name=template, build_id=build_id, skipped=tuple(plan.skipped),
                             seconds=round(time.monotonic() - t0, 3))


def _matched(root: Path, src: str, dest: str) -> None:
    """Raise InvalidRequest unless ``src`` names files of the context ``root``."""
    try:
        run_blocking(matched_files, root, src)
    except ValueError as exc:
        raise InvalidRequest(f"COPY {src} {dest}: {exc}", source=src) from None


def _copy(c: Hangar, template: str, root: Path, src: str, dest: str, t: float,
                say: Callable[[str, str], None]) -> str:
    """The files hash of ``COPY src dest``, its files uploaded unless the server has them."""
    _matched(root, src, dest)
    tar = run_blocking(make_archive, root, src)
    try:
        files_hash = run_blocking(archive_hash, tar, src, dest)
        link = c._json("GET", f"/e2b/templates/{template}/files/{files_hash}",
                             timeout=t, retry=True)
        if not link["present"]:
            _upload(c, link["url"], tar)
            say("info", f"uploaded the files of COPY {src} {dest}")
        return files_hash
    finally:
        tar.unlink(missing_ok=True)


def _upload(c: Hangar, url: str, tar: Path) -> None:
    """PUT the archive at ``tar`` to the signed ``url`` the server gave (no API key: the
    signature is the upload's credential)."""
    size = tar.stat().st_size
    t = c.config.timeouts.upload(size)
    if url.startswith("/"):
        url = c.config.url(url)
    try:
        r = c._http.put(url, content=file_chunks(tar), timeout=c.config.timeout(t),
                              headers={"Content-Length": str(size),
                                       "User-Agent": _core.USER_AGENT})
    except httpx.TransportError as exc:
        raise _core.transport_error(c.base_url, exc, t) from None
    if r.status_code >= 400:
        raise _core.error_for(r)


def _wait(c: Hangar, plan: Plan, template: str, build_id: str, t: float,
                timeout: float, t0: float, on_log: Callable[[BuildLog], None] | None) -> None:
    """Poll the build's status until it ends, passing its new log lines to ``on_log``;
    raise its failure, or RequestTimeout ``timeout`` seconds after ``t0`` (monotonic)."""
    offset = 0
    while True:
        st = c._json("GET", f"/e2b/templates/{template}/builds/{build_id}/status",
                           params={"logsOffset": offset}, timeout=t, retry=True)
        entries = st["logEntries"]
        for e in entries:
            if on_log is not None:
                on_log(BuildLog(level=e["level"], message=e["message"],
                                timestamp=e["timestamp"]))
        offset += len(entries)
        if st["status"] in ("ready", "error") and not entries:
            if st["status"] == "error":
                raise _dockerfile.build_failed(plan, template, build_id, st.get("reason"))
            return
        if time.monotonic() > t0 + timeout:
            raise RequestTimeout(f"the build {build_id} of {template} did not end within "
                                 f"{timeout:g} s; it may still end", outcome_unknown=True,
                                 timeout_s=timeout, build_id=build_id, name=template)
        if not entries:
            sleep(POLL_S)
