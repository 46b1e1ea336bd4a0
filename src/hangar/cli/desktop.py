"""``hangar desktop``: screenshots, pointer, keyboard and the live view of a desktop sandbox."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from hangar.cli.common import err, out, sdk


app = typer.Typer(help="Screenshots, mouse and keyboard of a desktop sandbox.",
                  no_args_is_help=True)


@app.command("screenshot")
def desktop_screenshot(sandbox_id: str, out_file: Path,
                       width: Annotated[Optional[int], typer.Option(help="Scale to pixels.")] = None,
                       ) -> None:
    """Save a PNG screenshot of the sandbox's desktop."""
    with sdk() as h:
        png = h.screenshot(sandbox_id, width)
    out_file.write_bytes(png)
    out.print(f"{out_file}: {len(png)} bytes")


@app.command("click")
def desktop_click(sandbox_id: str, x: int, y: int,
                  button: Annotated[str, typer.Option(help="left, middle or right")] = "left",
                  double: bool = False) -> None:
    """Click at (x, y), pixels."""
    if button not in ("left", "middle", "right"):
        err.print("[red]error:[/red] button must be left, middle or right")
        raise typer.Exit(2)
    with sdk() as h:
        h.click(sandbox_id, x, y, button, double)  # type: ignore[arg-type]


@app.command("move")
def desktop_move(sandbox_id: str, x: int, y: int) -> None:
    """Move the pointer to (x, y), pixels."""
    with sdk() as h:
        h.move(sandbox_id, x, y)


@app.command("drag")
def desktop_drag(sandbox_id: str, from_x: int, from_y: int, to_x: int, to_y: int) -> None:
    """Drag with the left button from one point to another, pixels."""
    with sdk() as h:
        h.drag(sandbox_id, from_x, from_y, to_x, to_y)


@app.command("type")
def desktop_type(sandbox_id: str, text: str) -> None:
    """Type text (any Unicode) into the focused window."""
    with sdk() as h:
        h.type(sandbox_id, text)


@app.command("key")
def desktop_key(sandbox_id: str, keys: str) -> None:
    """Press a key or combination, e.g. ctrl+shift+t or enter."""
    with sdk() as h:
        h.key(sandbox_id, keys)


@app.command("scroll")
def desktop_scroll(sandbox_id: str, direction: str, amount: int = 3) -> None:
    """Scroll up, down, left or right by wheel clicks."""
    if direction not in ("up", "down", "left", "right"):
        err.print("[red]error:[/red] direction must be up, down, left or right")
        raise typer.Exit(2)
    with sdk() as h:
        h.scroll(sandbox_id, direction, amount)  # type: ignore[arg-type]


@app.command("show")
def desktop_show(sandbox_id: str) -> None:
    """Screen size and cursor position."""
    with sdk() as h:
        d = h.display(sandbox_id)
    out.print(f"{d.width}x{d.height}x{d.depth}, cursor at ({d.cursor_x}, {d.cursor_y})")


@app.command("vnc")
def desktop_vnc(sandbox_id: str, view_only: bool = False) -> None:
    """Print a single-use ticket URL (valid 30 s) for the live view's WebSocket."""
    with sdk() as h:
        t = h.vnc_ticket(sandbox_id, view_only)
    out.print(h.base_url + t.url)
