"""Wire schemas of the desktop: screenshots, input actions, display and VNC tickets."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from hangar.schemas.base import Model


class ScreenshotResponse(Model):
    """A PNG screenshot, base64; ``width``/``height`` are the image's pixels."""

    format: Literal["png"] = "png"
    image: str = Field(description="The PNG, base64.")
    width: int
    height: int
    screen_width: int
    screen_height: int
    duration_s: float


class ActionResult(Model):
    """The answer to a pointer or keyboard action."""

    ok: Literal[True] = True


class KeyResult(ActionResult):
    keys: list[str] = Field(description="The combinations as sent to X, aliases resolved.")


class DisplayInfo(Model):
    """``GET /sandboxes/{id}/display``: the screen and the pointer."""

    width: int = Field(description="Pixels.")
    height: int = Field(description="Pixels.")
    depth: int = Field(description="Bits per pixel.")
    cursor_x: int
    cursor_y: int
    vnc: bool = Field(description="x11vnc listens: live viewing can connect.")


class VncTicket(Model):
    """A single-use ticket for the live desktop WebSocket."""

    ticket: str
    view_only: bool
    expires_at: float = Field(description="Unix time, seconds.")
    expires_in_s: float
    url: str = Field(description="Path of the WebSocket, ticket included (single use).")
