"""Structured logs: one JSON object a line on stderr.

Fields: ``ts`` (Unix seconds), ``level``, ``logger``, ``event`` (the
message) and whatever ``extra=`` carried (``sandbox_id``, ``duration_s``,
...). Keys that could carry a secret or file contents are dropped, so a
careless ``extra`` cannot leak them, and the value of a ``ticket=`` query
parameter (a WebSocket's single-use ticket, which uvicorn logs with the
path it upgrades) is replaced by ``***``.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time

REDACT = {"api_key", "key", "x-api-key", "authorization", "token", "secret", "password",
          "content", "data", "stdin", "env"}
TICKET = re.compile(r"([?&]ticket=)[^&\s\"']+")
_STD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": TICKET.sub(r"\1***", record.getMessage()),
        }
        for key, value in vars(record).items():
            if key in _STD or key.startswith("_") or key.lower() in REDACT:
                continue
            out[key] = value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info).splitlines()[-1]
        return json.dumps(out)


def setup(level: str = "INFO") -> None:
    """Send every ``hangar.*`` and uvicorn log line through ``JsonFormatter``.

    Levels below DEBUG (uvicorn's TRACE) are raised to DEBUG: at TRACE
    uvicorn logs each request's headers, API keys included.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    if root.level < logging.DEBUG:
        root.setLevel(logging.DEBUG)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers[:] = []
        lg.propagate = True
    logging.Formatter.converter = time.gmtime
