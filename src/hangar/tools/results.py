"""The one shape every tool call returns, and its forms for the Anthropic and OpenAI APIs.

A failing tool is a result the model reads (``ok`` false, ``error`` says
why), never an exception in the agent loop: a bad argument, a command that
exits non-zero, a page that does not load and a task stopped by its cost
guard all come back as a ``ToolResult``.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolResult:
    """Outcome of one tool call.

    ``output`` is text for the model (at most 1 MiB; ``truncated`` says that
    some was left out). ``image`` is PNG bytes for screenshots. ``data``
    holds the structured fields of each tool (``exit_code``, ``matches``,
    ``status``...). ``duration_s`` is wall seconds spent on the call.
    """

    ok: bool
    output: str = ""
    error: str | None = None
    truncated: bool = False
    duration_s: float = 0.0
    image: bytes | None = None
    data: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def failure(cls, error: str, duration_s: float = 0.0, **data: Any) -> "ToolResult":
        return cls(ok=False, error=error, duration_s=round(duration_s, 3), data=data)

    def text(self) -> str:
        """What a model should read: the output, then the error when there is one."""
        parts = [self.output] if self.output else []
        if self.truncated:
            parts.append("[output truncated]")
        if self.error:
            parts.append(f"error: {self.error}")
        if not parts:
            parts.append("ok" if self.ok else "failed")
        return "\n".join(parts)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: the image as base64 (``image_png_b64``)."""
        d: dict[str, Any] = {"ok": self.ok, "output": self.output, "error": self.error,
                             "truncated": self.truncated, "duration_s": self.duration_s,
                             **({"data": self.data} if self.data else {})}
        if self.image is not None:
            d["image_png_b64"] = base64.b64encode(self.image).decode()
        return d

    def to_anthropic(self, tool_use_id: str) -> dict[str, Any]:
        """A ``tool_result`` content block for the Anthropic Messages API."""
        content: list[dict[str, Any]] = [{"type": "text", "text": self.text()}]
        if self.image is not None:
            content.append({"type": "image", "source": {
                "type": "base64", "media_type": "image/png",
                "data": base64.b64encode(self.image).decode()}})
        return {"type": "tool_result", "tool_use_id": tool_use_id, "content": content,
                "is_error": not self.ok}

    def to_openai(self, tool_call_id: str) -> dict[str, Any]:
        """A ``tool`` message for the OpenAI Chat Completions API (text only: that role
        takes no images, so a screenshot is described by its size)."""
        text = self.text()
        if self.image is not None:
            text += f"\n[PNG screenshot, {len(self.image)} bytes, " \
                    f"{json.dumps(self.data.get('width'))}x{json.dumps(self.data.get('height'))}]"
        return {"role": "tool", "tool_call_id": tool_call_id, "content": text}


def cap_text(raw: bytes, limit: int) -> tuple[str, bool]:
    """The first ``limit`` bytes of ``raw`` as text (invalid UTF-8 replaced), and whether
    anything was cut. A character split by the cut is left out whole, not garbled."""
    if len(raw) <= limit:
        return raw.decode("utf-8", "replace"), False
    cut = limit
    while cut > 0 and limit - cut < 3 and raw[cut] & 0xC0 == 0x80:  # a continuation byte
        cut -= 1
    return raw[:cut].decode("utf-8", "replace"), True
