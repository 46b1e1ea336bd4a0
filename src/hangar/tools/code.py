"""``run_code``: a cell in the task sandbox's code interpreter (vm and browser tiers).

The sandbox must be of the ``code-interpreter`` image (a task started with
``image="code-interpreter"``): its kernel keeps variables between calls. In
a sandbox of another image the tool fails, saying so. The result's
``output`` is what the cell printed (stdout, then stderr), then its value
(``Out: ...``) and a line per other output; the first PNG chart is the
result's ``image``; an exception makes ``ok`` false with ``name: value`` as
the error and the traceback in the output. ``data`` holds
``execution_count``, ``results`` (formats of each) and ``error``.
"""

from __future__ import annotations

import base64
import time
from typing import Any, Protocol

from hangar.client import Execution
from hangar.errors import NoInterpreter
from hangar.tools.backend import Backend
from hangar.tools.definitions import MAX_OUTPUT_BYTES
from hangar.tools.results import ToolResult, cap_text

DEFAULT_TIMEOUT_S = 60.0


class _HasSandbox(Protocol):
    backend: Backend

    @property
    def sid(self) -> str: ...


async def run_code(tools: _HasSandbox, args: dict[str, Any],
                   time_left: float | None = None) -> ToolResult:
    """The ``run_code`` tool of ``tools`` (a ``VmTools`` or ``BrowserTools``)."""
    timeout = float(args.get("timeout_s") or DEFAULT_TIMEOUT_S)
    if time_left is not None:
        timeout = max(0.1, min(timeout, time_left))
    t0 = time.monotonic()
    try:
        ex = await tools.backend.run_code(tools.sid, str(args["code"]), timeout_s=timeout)
    except NoInterpreter:
        return ToolResult.failure("this task's sandbox has no code interpreter: start the task "
                                  "with image='code-interpreter', or run python3 with "
                                  "run_command", time.monotonic() - t0)
    return code_result(ex, time.monotonic() - t0)


def code_result(ex: Execution, took: float) -> ToolResult:
    """A ``ToolResult`` of an ``Execution`` (see the module docstring)."""
    parts = ["".join(ex.logs.stdout)]
    if ex.logs.stderr:
        parts.append("[stderr]\n" + "".join(ex.logs.stderr))
    image: bytes | None = None
    for r in ex.results:
        if r.png and image is None:
            image = base64.b64decode(r.png)
        if r.is_main_result:
            parts.append(f"Out: {r.text}")
        else:
            parts.append(f"[display: {', '.join(r.formats())}]"
                         + (f" {r.text}" if r.text and not r.png else ""))
    if ex.error is not None:
        parts.append(ex.error.traceback or f"{ex.error.name}: {ex.error.value}")
    text, cut = cap_text("\n".join(p for p in parts if p).encode(), MAX_OUTPUT_BYTES)
    data = {"execution_count": ex.execution_count,
            "results": [{"formats": r.formats(), "is_main_result": r.is_main_result}
                        for r in ex.results],
            "error": None if ex.error is None else {"name": ex.error.name,
                                                    "value": ex.error.value}}
    return ToolResult(ok=ex.error is None, output=text, truncated=cut,
                      error=None if ex.error is None else f"{ex.error.name}: {ex.error.value}",
                      duration_s=round(took, 3), image=image, data=data)
