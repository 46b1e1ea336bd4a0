"""``hangar mcp``: the agent tools of ``hangar.tools`` served over MCP (stdio or streamable
HTTP). ``hangar.cli.main`` registers it."""

from __future__ import annotations

from typing import Annotated, Any, Optional

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
    allow: Annotated[Optional[list[str]], typer.Option(
        "--allow", help="vm/browser: egress allowed to a domain, CIDR or HOST:PORT "
                        "(repeatable; docs/networking.md).")] = None,
    deny: Annotated[Optional[list[str]], typer.Option(
        "--deny", help="vm/browser: egress denied (repeatable; 0.0.0.0/0 makes --allow an "
                       "allowlist).")] = None,
    volume: Annotated[Optional[list[str]], typer.Option(
        "--volume", help="vm/browser: PATH=VOLUME mounted in each session's VM "
                         "(repeatable; docs/volumes.md).")] = None,
    secret: Annotated[Optional[list[str]], typer.Option(
        "--secret", help="vm/browser: ENV=SECRET, a placeholder the egress proxy replaces "
                         "for the secret's hosts (repeatable).")] = None,
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
    try:
        vm = vm_options(tier, allow, deny, volume, secret)
    except ValueError as exc:
        err.print(f"error: {exc}")
        raise typer.Exit(2) from None
    if transport == "stdio":
        asyncio.run(mcp_server.serve_stdio(tier, user_id, name, limits=limits, **vm))
    elif transport == "http":
        import uvicorn

        try:
            app_ = mcp_server.http_app(tier, user_id, name, host=host, idle_timeout_s=idle_timeout,
                                       limits=limits, **vm)
        except ValueError as exc:
            err.print(f"error: {exc}")
            raise typer.Exit(2) from None
        uvicorn.run(app_, host=host, port=port, log_level="warning")
    else:
        err.print(f"error: unknown transport {transport!r}; choose stdio or http")
        raise typer.Exit(2)


def vm_options(tier: str, allow: list[str] | None, deny: list[str] | None,
               volume: list[str] | None, secret: list[str] | None) -> dict[str, Any]:
    """The ``Task`` options of ``--allow/--deny/--volume/--secret``: ``network``,
    ``volumes``, ``secrets``. Raises ValueError naming a malformed one, or when the tier
    has no VM (``in-process``)."""
    out: dict[str, Any] = {}
    if allow or deny:
        out["network"] = {"allow": list(allow or []), "deny": list(deny or [])}
    for flag, values, key in (("--volume", volume, "volumes"), ("--secret", secret, "secrets")):
        pairs: dict[str, str] = {}
        for v in values or []:
            left, sep, right = v.partition("=")
            if not sep or not left or not right:
                shape = "PATH=VOLUME" if key == "volumes" else "ENV=SECRET"
                raise ValueError(f"{flag} {v!r}: give {shape}")
            pairs[left] = right
        if pairs:
            out[key] = pairs
    if out and tier == "in-process":
        raise ValueError("--allow, --deny, --volume and --secret shape a VM: use --tier vm or "
                         "browser")
    return out
