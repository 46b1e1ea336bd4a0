"""``hangar mcp``: the agent tools of ``hangar.tools`` served over MCP (stdio or streamable
HTTP). ``hangar.cli.main`` registers it."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from hangar.cli.common import err


def mcp(
    tier: Annotated[str, typer.Option(help="Tool tier: in-process, vm or browser.")] = "vm",
    transport: Annotated[str, typer.Option(help="stdio, or http (streamable HTTP at /mcp).")]
    = "stdio",
    host: Annotated[str, typer.Option(help="Address for http (which needs a bearer token "
                                           "in HANGAR_MCP_TOKEN).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port for http.")] = 8765,
    user_id: Annotated[str, typer.Option("--user", help="User id the tasks are made for.")]
    = "mcp",
    name: Annotated[str, typer.Option(help="Task name shown in events.")] = "MCP session",
    max_tool_calls: Annotated[Optional[int], typer.Option(help="Cost guard: tool calls per "
                                                                "session.")] = 200,
    max_wall_s: Annotated[Optional[float], typer.Option(help="Cost guard: seconds per "
                                                             "session.")] = 3600.0,
    idle_timeout: Annotated[float, typer.Option(help="http: seconds before an idle session "
                                                     "(and its VM) ends.")] = 1800.0,
) -> None:
    """Serve the agent tools over MCP: one task (one sandbox) per session, released when the
    session closes. Talks to the Hangar server at HANGAR_URL with HANGAR_API_KEY or the key
    file."""
    import asyncio

    from hangar.tools.definitions import check_tier
    from hangar.tools.limits import Limits
    from hangar.tools import mcp_server

    try:
        check_tier(tier)
    except ValueError as exc:
        err.print(f"error: {exc}")
        raise typer.Exit(2) from None
    limits = Limits(max_tool_calls=max_tool_calls, max_wall_s=max_wall_s, max_tokens=None)
    if transport == "stdio":
        asyncio.run(mcp_server.serve_stdio(tier, user_id, name, limits=limits))
    elif transport == "http":
        import uvicorn

        try:
            app_ = mcp_server.http_app(tier, user_id, name, host=host, idle_timeout_s=idle_timeout,
                                       limits=limits)
        except ValueError as exc:
            err.print(f"error: {exc}")
            raise typer.Exit(2) from None
        uvicorn.run(app_, host=host, port=port, log_level="warning")
    else:
        err.print(f"error: unknown transport {transport!r}; choose stdio or http")
        raise typer.Exit(2)
