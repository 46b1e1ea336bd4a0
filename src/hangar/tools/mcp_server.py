"""``hangar mcp``: the agent tools as an MCP server (the official ``mcp`` SDK, low-level API).

One task per MCP session, at the tier chosen by ``--tier``; the task (and so
its VM) is acquired at the session's first tool call and released when the
session closes:

* **stdio**: the process is the session. When the client closes our stdin
  the server loop ends and the task is ended (its VM deleted) before the
  process exits. The SDK's stdio client allows a server 2 s after closing
  stdin, then SIGTERM, then SIGKILL 2 s later: SIGTERM is ignored while the
  release runs, which takes about a second.
* **streamable HTTP** (``--transport http``, path ``/mcp``): sessions of the
  initialize handshake (``Mcp-Session-Id``). The server advertises only
  handshake-era protocol versions in ``server/discover``, so clients in
  ``auto`` mode open a session; a task ends when its session ends (client
  DELETE, idle timeout of ``--idle-timeout`` seconds, server shutdown), via
  the SDK's per-connection ``exit_stack``. A request without a session gets
  a tool error saying so. Listens on 127.0.0.1 by default. Every request
  must carry ``Authorization: Bearer <token>`` with the token of
  ``HANGAR_MCP_TOKEN``, on loopback too (any local process could reach an
  unauthenticated port and drive the sandboxes with the server's key); a
  missing or wrong token gets 401 before the body is read. Without the
  variable, or with a weak token (``hangar.keys.weakness``), the server
  does not start.

Tools are listed with the same JSON Schemas as ``hangar.tools.definitions``;
a call returns the ``ToolResult`` as MCP content: the text (output, then the
error), a PNG image for screenshots, ``isError`` when the tool failed, and
the result's fields as structured content.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import signal
from contextlib import asynccontextmanager
from typing import Any

import mcp_types as types
from mcp.server.lowlevel import Server
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS

from hangar import __version__
from hangar.tools.definitions import check_tier, tools_for
from hangar.tools.results import ToolResult
from hangar.tools.task import Task

log = logging.getLogger("hangar.tools.mcp")

STDIO_KEY = "stdio"
TOKEN_ENV = "HANGAR_MCP_TOKEN"


class SessionTasks:
    """One ``Task`` per session key, started on first use, ended on release."""

    def __init__(self, tier: str, user_id: str, name: str, options: dict[str, Any]) -> None:
        self.tier = check_tier(tier)
        self.user_id = user_id
        self.name = name
        self.options = options
        self._tasks: dict[object, Task] = {}
        self._starting: dict[object, asyncio.Lock] = {}
        self._releases: set[asyncio.Task[Any]] = set()

    async def get(self, key: object) -> Task:
        """The session's task, started (VM acquired) if it is the first call."""
        lock = self._starting.setdefault(key, asyncio.Lock())
        async with lock:
            t = self._tasks.get(key)
            if t is None:
                t = Task(self.tier, self.user_id, self.name, **self.options)
                await t.start()
                self._tasks[key] = t
            return t

    def release(self, key: object) -> None:
        """End the session's task in the background (its VM is deleted)."""
        self._starting.pop(key, None)
        t = self._tasks.pop(key, None)
        if t is not None:
            job = asyncio.get_running_loop().create_task(t.end("done"))
            self._releases.add(job)
            job.add_done_callback(self._releases.discard)

    async def close(self) -> None:
        """End every task and wait for all releases."""
        for key in list(self._tasks):
            self.release(key)
        if self._releases:
            await asyncio.gather(*self._releases, return_exceptions=True)


def to_mcp(result: ToolResult) -> types.CallToolResult:
    content: list[Any] = [types.TextContent(type="text", text=result.text())]
    if result.image is not None:
        import base64

        content.append(types.ImageContent(type="image", mime_type="image/png",
                                          data=base64.b64encode(result.image).decode()))
    structured = {k: v for k, v in result.as_dict().items() if k != "image_png_b64"}
    return types.CallToolResult(content=content, is_error=not result.ok,
                                structured_content=structured)


def _session_key(ctx: Any, tasks: SessionTasks, stdio: bool) -> object | None:
    """The key of the request's session; registers its release once (HTTP)."""
    if stdio:
        return STDIO_KEY
    # The SDK's per-connection state (``Connection``) is documented as the place for
    # per-connection teardown, but handlers reach it only through the session.
    conn = getattr(ctx.session, "_connection", None)
    if conn is None or getattr(conn, "session_id", None) is None:
        return None
    if not conn.state.get("hangar.release"):
        conn.state["hangar.release"] = True
        conn.exit_stack.callback(tasks.release, conn.session_id)
    return conn.session_id


def build_server(tasks: SessionTasks, stdio: bool) -> Server[Any]:
    """The MCP server for ``tasks``' tier."""
    specs = tools_for(tasks.tier)

    async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(tools=[
            types.Tool(name=s.name, description=s.description, input_schema=s.input_schema)
            for s in specs])

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        key = _session_key(ctx, tasks, stdio)
        if key is None:
            return to_mcp(ToolResult.failure(
                "this server keeps one sandbox per MCP session: connect with the initialize "
                "handshake (a session), not single stateless requests"))
        try:
            t = await tasks.get(key)
        except Exception as exc:
            msg = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
            return to_mcp(ToolResult.failure(f"could not start the {tasks.tier} task: {msg}"))
        return to_mcp(await t.call(params.name, params.arguments or {}))

    async def discover(ctx: Any, params: Any) -> types.DiscoverResult:
        # Handshake-era versions only: clients then open a session (see the module doc).
        return types.DiscoverResult(supported_versions=list(HANDSHAKE_PROTOCOL_VERSIONS),
                                    capabilities=server.get_capabilities(
                                        protocol_version=ctx.protocol_version))

    server: Server[Any] = Server(
        "hangar", version=__version__,
        instructions=f"Hangar agent tools, tier {tasks.tier}: each session gets its own "
                     f"sandbox, deleted when the session closes. Paths are relative to /work.",
        on_list_tools=list_tools, on_call_tool=call_tool)
    if not stdio:  # over stdio the process is the session, in either protocol era
        server.add_request_handler("server/discover", types.RequestParams, discover)
    return server


async def serve_stdio(tier: str, user_id: str, name: str, **options: Any) -> None:
    """Serve one session over stdin/stdout, then release its task."""
    from mcp.server.stdio import stdio_server

    tasks = SessionTasks(tier, user_id, name, options)
    server = build_server(tasks, stdio=True)
    try:
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())
    finally:
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # finish the release first
        try:
            await tasks.close()
        finally:
            signal.signal(signal.SIGTERM, previous)


def http_app(tier: str, user_id: str, name: str, *, host: str = "127.0.0.1",
             idle_timeout_s: float = 1800.0, **options: Any) -> Any:
    """The ASGI app of the streamable HTTP transport (path ``/mcp``).

    Raises ValueError when ``HANGAR_MCP_TOKEN`` is unset or weak: every request needs
    ``Authorization: Bearer <token>`` (401 otherwise).
    """
    from hangar.keys import weakness

    token = os.environ.get(TOKEN_ENV, "").strip()
    problem = weakness(token) if token else "it is unset"
    if problem:
        raise ValueError(
            f"MCP over HTTP needs a bearer token in {TOKEN_ENV}, and {problem}. Fix: "
            f"export {TOKEN_ENV}=$(python3 -c 'import secrets; print(secrets.token_urlsafe(32))')"
            f" and give the client the header 'Authorization: Bearer <token>'")
    tasks = SessionTasks(tier, user_id, name, options)
    server = build_server(tasks, stdio=False)
    app = server.streamable_http_app(host=host, session_idle_timeout=idle_timeout_s)
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: Any) -> Any:
        async with inner(a):
            try:
                yield
            finally:
                await tasks.close()

    app.router.lifespan_context = lifespan

    async def guarded(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, f"Bearer {token}".encode()):
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"www-authenticate", b"Bearer")]})
                await send({"type": "http.response.body", "body":
                            b'{"error": {"code": "unauthorized", "message": '
                            b'"missing or wrong bearer token"}}'})
                return
        await app(scope, receive, send)

    return guarded
