"""How the volume reader runs its tools (``hangar.images.volfs._run_one``): a tool that
writes far past what is read (a listing of a folder a guest filled with long names), or
much to stderr before its stdout ends, never holds the caller until the tool's timeout
(REVIEW29d D-M1). Real processes."""

from __future__ import annotations

import asyncio
import sys
import time

from hangar.images import volfs

FLOOD = "import sys\nfor _ in range(4096): sys.stdout.write('x' * 65536)\n"
"""256 MiB to stdout: a pipe holds 64 KiB, so the tool blocks unless it is read."""
ERR_FIRST = ("import sys\nsys.stderr.write('e' * (1 << 20)); sys.stderr.flush()\n"
             "sys.stdout.write('done')\n")


def test_a_tool_past_its_limit_is_stopped_at_once() -> None:
    started = time.monotonic()
    rc, out, _ = asyncio.run(volfs._run_one([sys.executable, "-c", FLOOD], limit=1 << 20,
                                            timeout=30, stop_past_limit=True))
    assert time.monotonic() - started < 10
    assert rc != 0 and len(out) > 1 << 20 and len(out) <= (1 << 20) + 65536


def test_a_tool_past_its_limit_runs_to_its_end_unkept() -> None:
    rc, out, _ = asyncio.run(volfs._run_one([sys.executable, "-c", FLOOD], limit=1 << 20,
                                            timeout=60))
    assert rc == 0 and len(out) <= (1 << 20) + 65536


def test_much_stderr_before_stdout_never_blocks() -> None:
    rc, out, err = asyncio.run(volfs._run_one([sys.executable, "-c", ERR_FIRST], limit=100,
                                              timeout=30))
    assert (rc, out) == (0, b"done") and err == "e" * 65536
