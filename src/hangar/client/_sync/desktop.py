# Generated from hangar/client/_async/desktop.py by scripts/gen_sync.py: do not edit.
"""A desktop sandbox's screen and input (sandboxes created with ``desktop="WxHxD"``);
the flat client's calls. Coordinates are pixels. See docs/desktop.md.

Mixed into ``AsyncHangar``; its methods run on the flat client (``self``). Source of
``hangar/client/_sync/desktop.py``.
"""

from __future__ import annotations

from typing import Any, Literal

from hangar.client import _core
from hangar.client._sync.mixin import flat_client as _client
from hangar.schemas import ActionResult, DisplayInfo, KeyResult, VncTicket


Button = Literal["left", "middle", "right"]
Direction = Literal["up", "down", "left", "right"]


class DesktopCalls:
    """The flat client's desktop methods (mixed into ``AsyncHangar``)."""

    # -- desktop (sandboxes created with desktop="WxHxD"); pixels ---------------------------

    def screenshot(self, sandbox_id: str, width: int | None = None, *,
                         request_timeout: float | None = None,
                         retry: bool | None = None) -> bytes:
        """``POST /sandboxes/{id}/screenshot``: the screen as PNG bytes.

        Scaled to ``width`` pixels when given. Default timeout 45 s. Raises
        Conflict (no desktop), Timeout (the desktop did not come up).
        """
        c = _client(self)
        params: dict[str, Any] = {"format": "png"}
        if width is not None:
            params["width"] = width
        t = c._t(request_timeout, c.config.timeouts.screenshot)
        return (c._send("POST", f"/sandboxes/{sandbox_id}/screenshot", params=params,
                              timeout=t, retry=retry is not False)).content

    def click(self, sandbox_id: str, x: int, y: int, button: Button = "left",
                    double: bool = False, *, request_timeout: float | None = None,
                    retry: bool | None = None) -> ActionResult:
        """``POST /sandboxes/{id}/click``: move the pointer to (``x``, ``y``) and click.

        Raises InvalidRequest off screen.
        """
        c = _client(self)
        return ActionResult.model_validate(c._desktop(
         sandbox_id, "click", request_timeout, retry, x=x, y=y, button=button,
         double=double))

    def move(self, sandbox_id: str, x: int, y: int, *,
                   request_timeout: float | None = None,
                   retry: bool | None = None) -> ActionResult:
        """``POST /sandboxes/{id}/move``: move the pointer to (``x``, ``y``)."""
        c = _client(self)
        return ActionResult.model_validate(c._desktop(
         sandbox_id, "move", request_timeout, retry, x=x, y=y))

    def drag(self,
                   sandbox_id: str, from_x: int, from_y: int, to_x: int, to_y: int,
                   button: Button = "left", *, request_timeout: float | None = None,
                   retry: bool | None = None) -> ActionResult:
        """``POST /sandboxes/{id}/drag``: press at (``from_x``, ``from_y``), move, release.

        The button is released at (``to_x``, ``to_y``).
        """
        c = _client(self)
        return ActionResult.model_validate(c._desktop(
         sandbox_id, "drag", request_timeout, retry, from_x=from_x, from_y=from_y,
         to_x=to_x, to_y=to_y, button=button))

    def type(self,
                   sandbox_id: str, text: str, *, request_timeout: float | None = None,
                   retry: bool | None = None) -> ActionResult:
        """``POST /sandboxes/{id}/type``: type any Unicode text exactly into the focused window."""
        c = _client(self)
        return ActionResult.model_validate(c._desktop(
         sandbox_id, "type", request_timeout, retry, text=text))

    def key(self,
                  sandbox_id: str, keys: str, *, request_timeout: float | None = None,
                  retry: bool | None = None) -> KeyResult:
        """``POST /sandboxes/{id}/key``: press keys, e.g. ``ctrl+shift+t`` or ``ctrl+a Delete``.

        Raises InvalidRequest naming an unknown key.
        """
        c = _client(self)
        return KeyResult.model_validate(c._desktop(
         sandbox_id, "key", request_timeout, retry, keys=keys))

    def scroll(self, sandbox_id: str, direction: Direction, amount: int = 3,
                     x: int | None = None, y: int | None = None, *,
                     request_timeout: float | None = None,
                     retry: bool | None = None) -> ActionResult:
        """``POST /sandboxes/{id}/scroll``: ``amount`` wheel clicks, at (``x``, ``y``) if given."""
        c = _client(self)
        return ActionResult.model_validate(c._desktop(
         sandbox_id, "scroll", request_timeout, retry, direction=direction, amount=amount,
         x=x, y=y))

    def display(self, sandbox_id: str, *, request_timeout: float | None = None,
                      retry: bool | None = None) -> DisplayInfo:
        """``GET /sandboxes/{id}/display``: screen size and pointer position, pixels."""
        c = _client(self)
        t = c._t(request_timeout, c.config.timeouts.screenshot)
        return DisplayInfo.model_validate(c._json(
         "GET", f"/sandboxes/{sandbox_id}/display", timeout=t, retry=retry is not False))

    def vnc_ticket(self, sandbox_id: str, view_only: bool = False, *,
                         request_timeout: float | None = None,
                         retry: bool | None = None) -> VncTicket:
        """``POST /sandboxes/{id}/vnc/tickets``: a single-use ticket (30 s) for the live view."""
        c = _client(self)
        t = c._t(request_timeout, c.config.timeouts.control)
        return VncTicket.model_validate(c._json(
         "POST", f"/sandboxes/{sandbox_id}/vnc/tickets", json={"view_only": view_only},
         timeout=t, retry=bool(retry)))

    def _desktop(self,
                       sandbox_id: str, action: str, request_timeout: float | None,
                       retry: bool | None, **body: Any) -> Any:
        c = _client(self)
        t = c._t(request_timeout, c.config.timeouts.screenshot)
        return c._json("POST", f"/sandboxes/{sandbox_id}/{action}",
                             json=_core.drop_none(**body), timeout=t, retry=bool(retry))
