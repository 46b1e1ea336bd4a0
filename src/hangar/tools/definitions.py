"""The agent tools: names, descriptions and JSON Schemas, and which tier offers which.

Tiers nest, ``in-process`` ⊂ ``vm`` ⊂ ``browser``::

    in-process   run_command, read_file, write_file            (bubblewrap on the host)
    vm           + search_code, run_code                       (a microVM of the dev image)
    browser      + browser_navigate, browser_interact,         (a microVM of the desktop
                   browser_screenshot                            image, Chromium over CDP)

Paths are absolute or relative to the task's work folder, ``/work`` in every
tier, so a model sees the same world wherever its tools run. Schemas are JSON
Schema (draft 2020-12 subset that both the Anthropic and the OpenAI
tool-calling formats accept); ``anthropic_tools`` and ``openai_tools`` export
them in each format, and ``validate`` checks a call's arguments against them
(with ``jsonschema``) before anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import jsonschema

from hangar.schemas.base import PATH_MAX

Tier = Literal["in-process", "vm", "browser"]
TIERS: tuple[Tier, ...] = ("in-process", "vm", "browser")

WORK_DIR = "/work"
"""The task's work folder, in every tier."""
MAX_OUTPUT_BYTES = 1 << 20
"""Output a tool hands back: 1 MiB, the rest counted and marked ``truncated``."""
MAX_COMMAND_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ToolSpec:
    """One tool: what a model is told about it."""

    name: str
    description: str
    input_schema: dict[str, Any] = field(hash=False)

    def anthropic(self) -> dict[str, Any]:
        """Anthropic Messages API ``tools`` entry."""
        return {"name": self.name, "description": self.description,
                "input_schema": self.input_schema}

    def openai(self) -> dict[str, Any]:
        """OpenAI Chat Completions ``tools`` entry (a function tool)."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description, "parameters": self.input_schema}}


def _obj(required: list[str], **props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


_PATH = {"type": "string", "minLength": 1, "maxLength": PATH_MAX,
         "description": f"File path, absolute or relative to the work folder {WORK_DIR}."}

RUN_COMMAND = ToolSpec(
    "run_command",
    "Run a shell command (/bin/sh -c) in the work folder and return its output (stdout, then "
    "stderr) and exit code. Output beyond 1 MiB is cut and marked truncated. Use it to build, "
    "test, install packages (vm and browser tiers have the internet) and inspect files.",
    _obj(["command"],
         command={"type": "string", "minLength": 1, "maxLength": 100_000,
                  "description": "The shell command, e.g. 'yarn test' or 'ls -la'."},
         timeout_s={"type": "number", "minimum": 1, "maximum": MAX_COMMAND_TIMEOUT_S,
                    "description": "Seconds before the command is killed (default 60)."},
         cwd={**_PATH, "description": f"Folder to run in (default {WORK_DIR})."}),
)
READ_FILE = ToolSpec(
    "read_file",
    "Read a text file and return its content (at most max_bytes, default and maximum 1 MiB; "
    "longer files are cut and marked truncated).",
    _obj(["path"], path=_PATH,
         max_bytes={"type": "integer", "minimum": 1, "maximum": MAX_OUTPUT_BYTES}),
)
WRITE_FILE = ToolSpec(
    "write_file",
    "Write text to a file, replacing it; missing parent folders are created.",
    _obj(["path", "content"], path=_PATH,
         content={"type": "string", "maxLength": 16 << 20, "description": "UTF-8 text."}),
)
SEARCH_CODE = ToolSpec(
    "search_code",
    "Search files for a regular expression with ripgrep (respects .gitignore) and return "
    "matches as path, line number and text, with a count of matches left out.",
    _obj(["pattern"],
         pattern={"type": "string", "minLength": 1, "maxLength": 1000,
                  "description": "Rust regex syntax, e.g. 'def \\w+_handler'."},
         path={**_PATH, "description": f"File or folder to search (default {WORK_DIR})."},
         glob={"type": "string", "maxLength": 200,
               "description": "Only files matching this glob, e.g. '*.py'."},
         ignore_case={"type": "boolean"},
         fixed_strings={"type": "boolean", "description": "Treat pattern as literal text."},
         max_results={"type": "integer", "minimum": 1, "maximum": 1000,
                      "description": "Matches returned (default 100)."}),
)
RUN_CODE = ToolSpec(
    "run_code",
    "Run Python in a stateful Jupyter kernel, like a notebook cell: variables, imports and "
    "functions persist from one call to the next. Returns what the code printed, the value of "
    "its last expression, charts (matplotlib figures as PNG) and any error with its "
    "traceback. numpy, pandas and matplotlib are installed. Needs a task whose image is "
    "code-interpreter.",
    _obj(["code"],
         code={"type": "string", "minLength": 1, "maxLength": 1 << 20,
               "description": "Python code, like a notebook cell."},
         timeout_s={"type": "number", "minimum": 1, "maximum": MAX_COMMAND_TIMEOUT_S,
                    "description": "Seconds before the cell is interrupted (default 60)."}),
)
BROWSER_NAVIGATE = ToolSpec(
    "browser_navigate",
    "Open a URL in the browser and return the final URL (after redirects), the HTTP status, "
    "the page title and the page's readable text (cut at 100 000 characters).",
    _obj(["url"],
         url={"type": "string", "minLength": 1, "maxLength": 8192,
              "description": "http(s) URL, e.g. http://127.0.0.1:8000/ for a server in the VM."},
         timeout_s={"type": "number", "minimum": 1, "maximum": 300}),
)
BROWSER_INTERACT = ToolSpec(
    "browser_interact",
    "Act on the current page: click, type (replaces a field's text), select an option, "
    "press a key or scroll; target an element by CSS selector or a point by x/y pixels. "
    "Returns the page's URL and title afterwards.",
    _obj(["action"],
         action={"type": "string", "enum": ["click", "type", "select", "press", "scroll"]},
         selector={"type": "string", "maxLength": 2000,
                   "description": "CSS selector of the element, e.g. '#email' or "
                                  "'form button[type=submit]'."},
         x={"type": "integer", "minimum": 0, "description": "Pixels from the left (click, "
                                                            "scroll)."},
         y={"type": "integer", "minimum": 0, "description": "Pixels from the top."},
         text={"type": "string", "maxLength": 100_000, "description": "Text to type."},
         value={"type": "string", "maxLength": 2000,
                "description": "Option value or label to select."},
         key={"type": "string", "maxLength": 100,
              "description": "Key to press, e.g. 'Enter', 'Tab', 'Control+A'."},
         delta_y={"type": "integer", "description": "Pixels to scroll down (negative: up); "
                                                    "default 500."},
         timeout_s={"type": "number", "minimum": 0.1, "maximum": 120,
                    "description": "Seconds to wait for the element (default 30)."}),
)
BROWSER_SCREENSHOT = ToolSpec(
    "browser_screenshot",
    "Take a PNG screenshot of the browser (the visible screen, or the whole page).",
    _obj([], full_page={"type": "boolean", "description": "The whole scrollable page."}),
)

TOOLS: dict[str, ToolSpec] = {t.name: t for t in (
    RUN_COMMAND, READ_FILE, WRITE_FILE, SEARCH_CODE, RUN_CODE,
    BROWSER_NAVIGATE, BROWSER_INTERACT, BROWSER_SCREENSHOT)}
"""Every tool by name."""

_IN_PROCESS = ("run_command", "read_file", "write_file")
_VM = _IN_PROCESS + ("search_code", "run_code")
_BROWSER = _VM + ("browser_navigate", "browser_interact", "browser_screenshot")
TIER_TOOLS: dict[Tier, tuple[str, ...]] = {"in-process": _IN_PROCESS, "vm": _VM,
                                           "browser": _BROWSER}
"""Tool names each tier offers; each tier's set contains the previous one's."""


def check_tier(tier: str) -> Tier:
    """``tier`` if it is one of ``TIERS``; raises ValueError naming them otherwise."""
    if tier not in TIER_TOOLS:
        raise ValueError(f"unknown tier {tier!r}; choose one of {', '.join(TIERS)}")
    return tier  # type: ignore[return-value]


def tools_for(tier: str) -> list[ToolSpec]:
    """The specs of ``tier``'s tools. Raises ValueError for an unknown tier."""
    return [TOOLS[n] for n in TIER_TOOLS[check_tier(tier)]]


def anthropic_tools(tier: str) -> list[dict[str, Any]]:
    """``tier``'s tools for the Anthropic Messages API (``tools=``)."""
    return [t.anthropic() for t in tools_for(tier)]


def openai_tools(tier: str) -> list[dict[str, Any]]:
    """``tier``'s tools for the OpenAI Chat Completions API (``tools=``)."""
    return [t.openai() for t in tools_for(tier)]


def validate(name: str, arguments: Any) -> str | None:
    """None when ``arguments`` fit tool ``name``'s schema, else a one-line reason."""
    spec = TOOLS.get(name)
    if spec is None:
        return f"unknown tool {name!r}"
    if not isinstance(arguments, dict):
        return "arguments must be a JSON object"
    error = jsonschema.exceptions.best_match(
        jsonschema.Draft202012Validator(spec.input_schema).iter_errors(arguments))
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path)
    return f"{where + ': ' if where else ''}{error.message}"[:500]
