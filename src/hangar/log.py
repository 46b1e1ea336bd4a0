"""Structured logs: one JSON object a line on stderr.

Fields: ``ts`` (Unix seconds), ``level``, ``logger``, ``event`` (the
message) and whatever ``extra=`` carried (``sandbox_id``, ``duration_s``,
...). Keys that could carry a secret or file contents are dropped, so a
careless ``extra`` cannot leak them, and the value of a credential query
parameter (``QUERY_SECRETS``: a WebSocket's single-use ticket, which uvicorn
logs with the path it upgrades, a port token...) is replaced by ``***``,
whatever percent-encoding its name or the whole query wears.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from collections.abc import Callable
from urllib.parse import unquote_plus

REDACT = {"api_key", "key", "x-api-key", "authorization", "token", "secret", "password",
          "content", "data", "stdin", "env"}
QUERY_SECRETS = ("ticket", "hangar_token", "token", "access_token", "accesstoken", "signature",
                 "key", "api_key", "apikey", "x-api-key", "secret", "password")
"""Query parameters whose values never reach a log line."""
PARAM = re.compile(
    r"((?:[?&;]|%3[Ff]|%26|%3[Bb])"                          # the separator, or its escape
    r"((?:[^=&;?\s\"'#%]|%(?!3[DdFfBb]|26)[0-9A-Fa-f]{2})*)"  # the name as written
    r"(?:=|%3[Dd]))([^&;\s\"'#]+)")                           # = (or %3D), the value
"""One query parameter in a logged line (after ``?``, ``&`` or ``;``, themselves perhaps
percent-encoded): its lead-in with name (group 1), the name as written (2), its value (3)."""
MAX_DECODES = 3
"""Times a parameter's name is percent-decoded before it is compared (``%2574oken``...)."""


def _name(raw: str) -> str:
    """A parameter's name as a server would read it: percent-decoded (repeatedly, so a
    double-encoded name is seen too) and ``+`` as a space, lower-cased."""
    name = raw
    for _ in range(MAX_DECODES):
        decoded = unquote_plus(name)
        if decoded == name:
            break
        name = decoded
    return name.strip().lower()


MAX_NESTING = 4
"""URLs inside parameters' values (``next=%2Fp%3Ftoken%3D...``) looked into, deepest."""


def _hiding(depth: int) -> Callable[[re.Match[str]], str]:
    def hide(m: re.Match[str]) -> str:
        if _name(m.group(2)) in QUERY_SECRETS:
            return m.group(1) + "***"
        if depth >= MAX_NESTING:
            return m.group(0)
        return m.group(1) + PARAM.sub(_hiding(depth + 1), m.group(3))
    return hide


SECRET_PARAM = PARAM
"""The old name of ``PARAM`` (use ``redact``: it decides by the decoded name)."""
TICKET = SECRET_PARAM
"""The old name of ``SECRET_PARAM``."""
CLIENT_FAULTS = frozenset({"Invalid HTTP request received.", "Unsupported upgrade request.",
                           "No supported WebSocket library detected. Please use \"pip install "
                           "'uvicorn[standard]'\", or install 'websockets' or 'wsproto' manually."})
"""uvicorn's messages (logged at WARNING) about what a client sent: INFO here."""


def redact(text: str) -> str:
    """``text`` with the value of every ``QUERY_SECRETS`` parameter replaced by ``***``,
    however its name is percent-encoded (``?%74oken=``, ``?hangar%5Ftoken=``)."""
    return PARAM.sub(_hiding(0), text)


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
