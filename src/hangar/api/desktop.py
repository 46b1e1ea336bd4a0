"""``/sandboxes/{id}/screenshot``, ``/click``, ``/move``, ``/drag``, ``/type``, ``/key``,
``/scroll`` and ``/display``: computer use on a desktop sandbox.

HTTP only; the work is in ``hangar.core.desktop``. Coordinates are screen
pixels from the top-left corner (0, 0) to (width-1, height-1). A sandbox
without a desktop answers 409; bad coordinates, keys or widths 400; a
desktop that does not come up within two minutes 504.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Depends, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import ConfigDict, Field

from hangar.api.deps import manager
from hangar.api.models import RequestBody
from hangar.api.sandboxes import b64_pieces
from hangar.core.service import (
    MAX_SCROLL, MAX_TYPE_CHARS, TYPE_DELAY_MS, Desktop, SandboxManager,
)
from hangar.schemas import ActionResult as ActionResponse
from hangar.schemas import DisplayInfo as DisplayResponse
from hangar.schemas import KeyResult as KeyResponse
from hangar.schemas import ScreenshotResponse

router = APIRouter(prefix="/sandboxes", tags=["desktop"])


async def desktop(m: Annotated[SandboxManager, Depends(manager)]) -> Desktop:
    """The server's ``Desktop`` (``SandboxManager.desktop``)."""
    return m.desktop


DesktopDep = Annotated[Desktop, Depends(desktop)]
Coord = Annotated[int, Field(ge=-(2**31), le=2**31 - 1, description="Pixels.")]


class ScreenshotRequest(RequestBody):
    model_config = ConfigDict(extra="forbid")

    width: int | None = Field(None, ge=1, le=16384,
                              description="Scale to this width in pixels, keeping the aspect.")


class Point(RequestBody):
    model_config = ConfigDict(extra="forbid")

    x: Coord
    y: Coord


class ClickRequest(Point):
    button: Literal["left", "middle", "right"] = "left"
    double: bool = False


class DragRequest(RequestBody):
    model_config = ConfigDict(extra="forbid")

    from_x: Coord
    from_y: Coord
    to_x: Coord
    to_y: Coord
    button: Literal["left", "middle", "right"] = "left"


class TypeRequest(RequestBody):
    model_config = ConfigDict(extra="forbid")

    text: str = Field(min_length=1, max_length=MAX_TYPE_CHARS,
                      description="Any Unicode text; a line break (\\n, \\r\\n) presses "
                                  "Return, a tab Tab.")
    delay_ms: int = Field(TYPE_DELAY_MS, ge=1, le=1000,
                          description="Pause between characters, milliseconds.")


class KeyRequest(RequestBody):
    model_config = ConfigDict(extra="forbid")

    keys: str = Field(min_length=1, max_length=1000, description=(
        "Space-separated combinations of key names joined by '+', e.g. 'ctrl+shift+t' or "
        "'ctrl+a Delete'. Names are X keysyms (Return, Page_Down, F5, a) or aliases "
        "(enter, esc, pgdn, ctrl, alt, shift, super...)."))


class ScrollRequest(RequestBody):
    model_config = ConfigDict(extra="forbid")

    direction: Literal["up", "down", "left", "right"]
    amount: int = Field(3, ge=1, le=MAX_SCROLL, description="Wheel clicks.")
    x: Coord | None = Field(None, description="Move here first (with y), pixels.")
    y: Coord | None = None


def _wants_png(request: Request, fmt: str | None) -> bool:
    if fmt is not None:
        return fmt == "png"
    accept = request.headers.get("accept", "")
    return "image/png" in accept and "application/json" not in accept


@router.post(
    "/{sandbox_id}/screenshot", response_model=ScreenshotResponse,
    summary="Take a screenshot (JSON with a base64 PNG, or raw image/png)",
    responses={200: {"content": {"image/png": {}}, "description": (
        "JSON by default; the raw PNG when `format=png` or the Accept header asks for "
        "image/png (then X-Image-Width and X-Image-Height give its size).")}},
)
async def screenshot(
    sandbox_id: str, request: Request, d: DesktopDep,
    body: Annotated[ScreenshotRequest | None, Body()] = None,
    width: Annotated[int | None, Query(ge=1, le=16384, description="Pixels.")] = None,
    format: Annotated[Literal["json", "png"] | None, Query()] = None,
) -> Response | ScreenshotResponse:
    want = width if width is not None else (body.width if body else None)
    shot = await d.screenshot(sandbox_id, want)
    if _wants_png(request, format):
        return Response(shot.png, media_type="image/png", headers={
            "X-Image-Width": str(shot.width), "X-Image-Height": str(shot.height),
            "Cache-Control": "no-store"})
    if len(shot.png) <= INLINE_PNG_BYTES:
        return ScreenshotResponse(
            image=base64.b64encode(shot.png).decode(), width=shot.width, height=shot.height,
            screen_width=shot.screen.width, screen_height=shot.screen.height,
            duration_s=round(shot.duration_s, 4))
    return StreamingResponse(_json_pieces(shot), media_type="application/json")


INLINE_PNG_BYTES = 1 << 20
"""A screenshot's PNG up to this size (bytes) is encoded into its JSON answer at once (a
few ms); a larger one (a large desktop's, up to ``core.desktop.shot_max_bytes``: 66 MiB at
4096 x 4096) is streamed a piece at a time (``sandboxes.b64_pieces``) with a turn of the
loop between, so that no tenant's screenshot holds the event loop (review 29k: 1 s for 66
MiB at once)."""



async def _json_pieces(shot: Any) -> AsyncIterator[bytes]:
    """``ScreenshotResponse``'s JSON for ``shot``, in pieces: the same keys and values as
    the model gives."""
    yield b'{"format":"png","image":"'
    for piece in b64_pieces(shot.png):
        yield piece
        await asyncio.sleep(0)
    tail = {"width": shot.width, "height": shot.height, "screen_width": shot.screen.width,
            "screen_height": shot.screen.height, "duration_s": round(shot.duration_s, 4)}
    yield b'",' + json.dumps(tail, separators=(",", ":")).encode()[1:]


@router.post("/{sandbox_id}/click", response_model=ActionResponse,
             summary="Move the pointer to (x, y) and click")
async def click(sandbox_id: str, body: ClickRequest, d: DesktopDep) -> ActionResponse:
    await d.click(sandbox_id, body.x, body.y, body.button, body.double)
    return ActionResponse()


@router.post("/{sandbox_id}/move", response_model=ActionResponse,
             summary="Move the pointer to (x, y)")
async def move(sandbox_id: str, body: Point, d: DesktopDep) -> ActionResponse:
    await d.move(sandbox_id, body.x, body.y)
    return ActionResponse()


@router.post("/{sandbox_id}/drag", response_model=ActionResponse,
             summary="Press a button at (from_x, from_y), move to (to_x, to_y), release")
async def drag(sandbox_id: str, body: DragRequest, d: DesktopDep) -> ActionResponse:
    await d.drag(sandbox_id, body.from_x, body.from_y, body.to_x, body.to_y, body.button)
    return ActionResponse()


@router.post("/{sandbox_id}/type", response_model=ActionResponse,
             summary="Type text into the focused window")
async def type_(sandbox_id: str, body: TypeRequest, d: DesktopDep) -> ActionResponse:
    await d.type(sandbox_id, body.text, body.delay_ms)
    return ActionResponse()


@router.post("/{sandbox_id}/key", response_model=KeyResponse,
             summary="Press key combinations such as ctrl+shift+t")
async def key(sandbox_id: str, body: KeyRequest, d: DesktopDep) -> KeyResponse:
    return KeyResponse(keys=await d.key(sandbox_id, body.keys))


@router.post("/{sandbox_id}/scroll", response_model=ActionResponse,
             summary="Scroll the wheel, optionally at (x, y)")
async def scroll(sandbox_id: str, body: ScrollRequest, d: DesktopDep) -> ActionResponse:
    await d.scroll(sandbox_id, body.direction, body.amount, body.x, body.y)
    return ActionResponse()


@router.get("/{sandbox_id}/display", response_model=DisplayResponse,
            summary="Screen size and pointer position")
async def display(sandbox_id: str, d: DesktopDep) -> DisplayResponse:
    info = await d.display(sandbox_id)
    return DisplayResponse(width=info.width, height=info.height, depth=info.depth,
                           cursor_x=info.cursor_x, cursor_y=info.cursor_y, vnc=info.vnc)
