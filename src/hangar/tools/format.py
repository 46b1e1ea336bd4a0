"""What every tier shares: paths, command results and one-line summaries for events."""

from __future__ import annotations

import posixpath
import signal as signals
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from hangar.tools.definitions import MAX_OUTPUT_BYTES, WORK_DIR
from hangar.tools.results import ToolResult, cap_text

SUMMARY_CHARS = 200


def resolve(path: str | None, default: str = WORK_DIR) -> str:
    """An absolute, normalized guest path: relative ones start at the work folder."""
    if not path:
        return default
    return posixpath.normpath(posixpath.join(WORK_DIR, path))


def command_result(*, exit_code: int | None, signal: int | None, timed_out: bool,
                   stdout: bytes, stderr: bytes, stdout_total: int, stderr_total: int,
                   duration_s: float, timeout_s: float, limit_note: str | None = None
                   ) -> ToolResult:
    """A ``run_command`` result: stdout, then stderr under a ``[stderr]`` line, at most
    1 MiB together. ``limit_note`` names a resource limit that ended the command."""
    out, cut_out = cap_text(stdout, MAX_OUTPUT_BYTES)
    room = max(0, MAX_OUTPUT_BYTES - len(stdout))
    err, cut_err = cap_text(stderr, room) if stderr else ("", False)
    text = out
    if err:
        text += ("" if not out or out.endswith("\n") else "\n") + "[stderr]\n" + err
    truncated = cut_out or cut_err or stdout_total > len(stdout) or stderr_total > len(stderr)
    error = None
    if timed_out:
        error = f"timed out after {timeout_s:g} s; the command was killed"
    elif limit_note:
        error = limit_note
    elif signal:
        try:
            name = signals.Signals(signal).name
        except ValueError:
            name = str(signal)
        error = f"killed by signal {name}"
    elif exit_code != 0:
        error = f"exited with code {exit_code}"
    return ToolResult(ok=error is None, output=text, error=error, truncated=truncated,
                      duration_s=round(duration_s, 3),
                      data={"exit_code": exit_code, "signal": signal, "timed_out": timed_out,
                            "stdout_bytes": stdout_total, "stderr_bytes": stderr_total})


def summarize(tool: str, args: dict[str, Any]) -> str:
    """One line for a person watching: the command, path, pattern or URL (no query)."""
    if tool == "run_command":
        s = str(args.get("command", "")).strip().splitlines()[0] if args.get("command") else ""
    elif tool in ("read_file", "write_file"):
        s = str(args.get("path", ""))
    elif tool == "search_code":
        s = f"{args.get('pattern', '')} in {args.get('path') or WORK_DIR}"
    elif tool == "browser_navigate":
        try:
            u = urlsplit(str(args.get("url", "")))
            host = u.hostname or ""
            if u.port:
                host += f":{u.port}"
            s = urlunsplit((u.scheme, host, u.path, "", ""))
        except ValueError:
            s = "(invalid URL)"
    elif tool == "browser_interact":
        target = args.get("selector") or (
            f"({args.get('x')}, {args.get('y')})" if "x" in args else "")
        s = f"{args.get('action', '')} {target}".strip()
    elif tool == "browser_screenshot":
        s = "full page" if args.get("full_page") else "screen"
    else:
        s = ""
    return s if len(s) <= SUMMARY_CHARS else s[:SUMMARY_CHARS - 1] + "…"
