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
QUERY_SECRETS = ("ticket", "hangar_token", "token", "access_token", "accesstoken", "signature",
                 "key", "api_key", "apikey", "x-api-key", "secret", "password")
"""Query parameters whose values never reach a log line."""
SECRET_PARAM = re.compile(
    r"((?:[?&;]|%3[Ff]|%26)(?:" + "|".join(re.escape(p) for p in QUERY_SECRETS) +
    r")(?:=|%3[Dd]))[^&;\s\"'#]+", re.IGNORECASE)
TICKET = SECRET_PARAM
"""The old name of ``SECRET_PARAM``."""
CLIENT_FAULTS = frozenset({"Invalid HTTP request received.", "Unsupported upgrade request.",
                           "No supported WebSocket library detected. Please use \"pip install "
                           "'uvicorn[standard]'\", or install 'websockets' or 'wsproto' manually."})
"""uvicorn's messages (logged at WARNING) about what a client sent: INFO here."""


def redact(text: str) -> str:
    """``text`` with the value of every ``QUERY_SECRETS`` parameter replaced by ``***``."""
    return SECRET_PARAM.sub(r"\1***", text)


class ClientFaults(logging.Filter):
    """Lowers uvicorn's WARNINGs about a client's malformed request to INFO."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING and record.name.startswith("uvicorn") \
                and record.msg in CLIENT_FAULTS:
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True
_STD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": redact(record.getMessage()),
        }
        for key, value in vars(record).items():
            if key in _STD or key.startswith("_") or key.lower() in REDACT:
                continue
            if not isinstance(value, (int, float, bool, type(None))):
                value = redact(str(value))
            out[key] = value
        if record.exc_info:
            out["exc"] = redact(self.formatException(record.exc_info).splitlines()[-1])
        return json.dumps(out)


def setup(level: str = "INFO") -> None:
    """Send every ``hangar.*`` and uvicorn log line through ``JsonFormatter``.

    Levels below DEBUG (uvicorn's TRACE) are raised to DEBUG: at TRACE
    uvicorn logs each request's headers, API keys included.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(ClientFaults())
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
