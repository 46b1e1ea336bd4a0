"""The vm tier: tools run inside the task's own microVM (the ``dev`` image by default).

``run_command`` is an exec in the guest (``/bin/sh -c``, in ``/work``);
``read_file`` reads at most 1 MiB with ``head -c`` (a huge file is never
pulled whole); ``write_file`` is the API's atomic file write (parents
made); ``search_code`` runs ripgrep in the guest with ``--json`` and keeps
the first ``max_results`` matches, counting the rest from ripgrep's own
summary. The guest has the sandbox's egress policy (``internet`` by default
with TAP networking: public addresses only) and none of the platform's
credentials: nothing of the caller's environment is passed in.
"""

from __future__ import annotations

import json
from typing import Any

from hangar.tools.backend import Backend, SandboxInfo
from hangar.tools.code import run_code
from hangar.tools.definitions import MAX_OUTPUT_BYTES, WORK_DIR
from hangar.tools.format import command_result, resolve
from hangar.tools.results import ToolResult, cap_text
from hangar.tools.toolset import ToolSet

DEFAULT_TIMEOUT_S = 60.0
MAX_MATCH_CHARS = 500
"""Characters of a matching line kept in ``search_code`` results."""


class VmTools(ToolSet):
    """``run_command``, ``read_file``, ``write_file`` and ``search_code`` in one sandbox."""

    tier = "vm"

    def __init__(self, backend: Backend, sandbox: SandboxInfo) -> None:
        self.backend = backend
        self.sandbox = sandbox

    @property
    def sid(self) -> str:
        return self.sandbox.id

    async def prepare(self) -> None:
        """Make the work folder."""
        await self.backend.mkdir(self.sid, WORK_DIR)

    async def run_command(self, args: dict[str, Any], time_left: float | None) -> ToolResult:
        timeout = float(args.get("timeout_s") or DEFAULT_TIMEOUT_S)
        if time_left is not None:
            timeout = max(0.1, min(timeout, time_left))
        r = await self.backend.exec(self.sid, str(args["command"]), cwd=resolve(args.get("cwd")),
                                    timeout_s=timeout)
        return command_result(exit_code=r.exit_code, signal=r.signal, timed_out=r.timed_out,
                              stdout=r.stdout, stderr=r.stderr, stdout_total=r.stdout_total,
                              stderr_total=r.stderr_total, duration_s=r.duration_s,
                              timeout_s=timeout)

    async def read_file(self, args: dict[str, Any], time_left: float | None = None
                       ) -> ToolResult:
        path = resolve(str(args["path"]))
        limit = int(args.get("max_bytes") or MAX_OUTPUT_BYTES)
        r = await self.backend.exec(self.sid, "head", args=["-c", str(limit + 1), "--", path],
                                    timeout_s=60)
        if r.exit_code != 0:
            msg = r.stderr.decode("utf-8", "replace").strip().removeprefix("head: ")
            return ToolResult.failure(msg or f"cannot read {path}", r.duration_s)
        text, cut = cap_text(r.stdout, limit)
        return ToolResult(ok=True, output=text, truncated=cut or r.stdout_total > limit,
                          duration_s=round(r.duration_s, 3), data={"path": path})

    async def write_file(self, args: dict[str, Any], time_left: float | None = None
                        ) -> ToolResult:
        path = resolve(str(args["path"]))
        data = str(args["content"]).encode()
        size = await self.backend.write_file(self.sid, path, data)
        return ToolResult(ok=True, output=f"wrote {size} bytes to {path}",
                          data={"path": path, "size": size})

    async def search_code(self, args: dict[str, Any], time_left: float | None = None
                         ) -> ToolResult:
        keep = int(args.get("max_results") or 100)
        argv = ["--json", "--max-columns", str(MAX_MATCH_CHARS), "--max-columns-preview"]
        if args.get("ignore_case"):
            argv.append("--ignore-case")
        if args.get("fixed_strings"):
            argv.append("--fixed-strings")
        if args.get("glob"):
            argv += ["--glob", str(args["glob"])]
        target = resolve(args.get("path")) if args.get("path") else "."
        argv += ["-e", str(args["pattern"]), "--", target]
        r = await self.backend.exec(self.sid, "rg", args=argv, cwd=WORK_DIR, timeout_s=120)
        if r.exit_code == 127 or (r.exit_code is None and not r.stdout):
            return ToolResult.failure("ripgrep (rg) is not installed in this sandbox's image",
                                      r.duration_s)
        matches, total = parse_rg_json(r.stdout, r.stdout_tail, keep)
        if r.exit_code == 2 and not matches:
            return ToolResult.failure(r.stderr.decode("utf-8", "replace").strip()[:2000]
                                      or "ripgrep failed", r.duration_s)
        left_out = max(0, total - len(matches))
        lines = [f"{m['path']}:{m['line']}: {m['text']}" for m in matches]
        if left_out:
            lines.append(f"[{left_out} more matches not shown]")
        if not matches:
            lines.append("no matches")
        return ToolResult(ok=True, output="\n".join(lines), truncated=left_out > 0,
                          duration_s=round(r.duration_s, 3),
                          data={"matches": matches, "total": total, "left_out": left_out})

    HANDLERS = {"run_command": run_command, "read_file": read_file, "write_file": write_file,
                "search_code": search_code, "run_code": run_code}


def parse_rg_json(head: bytes, tail: bytes, keep: int) -> tuple[list[dict[str, Any]], int]:
    """Matches (path, line, text) from ``rg --json`` output, at most ``keep``, and the
    total number of matching lines (from ripgrep's summary when present; when the
    output was cut, the summary is in ``tail``, the output's last bytes)."""
    matches: list[dict[str, Any]] = []
    seen = 0
    total: int | None = None
    for source, lines in (("head", head.splitlines()), ("tail", tail.splitlines()[-3:])):
        for raw in lines:
            try:
                msg = json.loads(raw)
            except ValueError:
                continue  # a line cut by the output cap
            kind = msg.get("type")
            if kind == "match" and source == "head":
                seen += 1
                if len(matches) < keep:
                    d = msg["data"]
                    text = d["lines"].get("text")
                    if text is None:
                        text = "(binary or non-UTF-8 line)"
                    path = d["path"].get("text", "?")
                    matches.append({"path": path.removeprefix("./"),
                                    "line": d.get("line_number"),
                                    "text": text.rstrip("\n")[:MAX_MATCH_CHARS]})
            elif kind == "summary":
                total = int(msg["data"]["stats"].get("matched_lines", 0))
    return matches, total if total is not None else seen
