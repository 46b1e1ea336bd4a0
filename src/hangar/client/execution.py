"""What ``run_code`` returns: an ``Execution`` with its results, logs and error.

The shapes follow E2B's code interpreter, so code written against its SDK
reads Hangar's the same way: ``execution.text`` is the cell's value as
text, ``execution.results`` every output with formats (``png`` is base64),
``execution.logs.stdout``/``stderr`` lists of printed chunks and
``execution.error`` the exception (``name``, ``value``, ``traceback``).
``apply_line`` folds one NDJSON line of ``POST /sandboxes/{id}/code/execute``
into an ``Execution``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FORMATS = ("text", "html", "markdown", "svg", "png", "jpeg", "pdf", "latex", "json",
           "javascript", "data", "chart")


@dataclass
class OutputMessage:
    """One chunk printed by the cell: ``line`` (text as printed, newlines included),
    ``timestamp`` (Unix ns, when the server got it), ``error`` (True for stderr)."""

    line: str
    timestamp: int
    error: bool = False

    def __str__(self) -> str:
        return self.line


@dataclass
class ExecutionError:
    """The exception a cell raised: ``name`` (``ZeroDivisionError``), ``value`` (its
    message) and ``traceback`` (text, no colour codes)."""

    name: str
    value: str
    traceback: str


@dataclass
class Result:
    """One output: the cell's value (``is_main_result``) or a ``display`` call (a
    matplotlib figure). Each format present is set: ``text`` (a Python ``str`` value's text
    without its quotes, as E2B's), ``png``/``jpeg``/``pdf`` base64 text, ``json`` a decoded
    value, ``data`` a pandas DataFrame's columns (``{name: [values]}``), ``chart`` a
    matplotlib figure described as data (E2B's shape: ``type`` such as ``bar``, ``line``,
    ``scatter``, ``pie``, ``box_and_whisker``, ``superchart``; ``title``; ``elements``; axis
    labels, units, ticks and scales), other MIME types in ``extra``."""

    text: str | None = None
    html: str | None = None
    markdown: str | None = None
    svg: str | None = None
    png: str | None = None
    jpeg: str | None = None
    pdf: str | None = None
    latex: str | None = None
    json: Any = None
    javascript: str | None = None
    data: dict[str, Any] | None = None
    chart: dict[str, Any] | None = None
    is_main_result: bool = False
    extra: dict[str, Any] | None = None

    def formats(self) -> list[str]:
        """The formats present, in the order of ``FORMATS``, then ``extra``'s keys."""
        return ([f for f in FORMATS if getattr(self, f) is not None]
                + list(self.extra or {}))


@dataclass
class Logs:
    """Everything the cell printed, chunk by chunk."""

    stdout: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)


@dataclass
class Execution:
    """One cell's outcome: ``results``, ``logs``, ``error`` (None when it ran through),
    ``execution_count`` (the kernel's counter)."""

    results: list[Result] = field(default_factory=list)
    logs: Logs = field(default_factory=Logs)
    error: ExecutionError | None = None
    execution_count: int | None = None

    @property
    def text(self) -> str | None:
        """The cell's value as text (its main result's ``text``), or None."""
        for r in self.results:
            if r.is_main_result:
                return r.text
        return None


@dataclass
class CodeContext:
    """A context: one kernel with its own variables; ``cwd`` is where it runs."""

    id: str
    language: str
    cwd: str


def apply_line(execution: Execution, data: dict[str, Any]) -> tuple[str, Any] | None:
    """Fold one decoded line into ``execution``; returns (``"stdout"``, ``"stderr"``,
    ``"result"`` or ``"error"``, the new object) for the caller's callback, else None."""
    kind = data.get("type")
    if kind in ("stdout", "stderr"):
        text = str(data.get("text", ""))
        getattr(execution.logs, kind).append(text)
        return kind, OutputMessage(text, int(data.get("timestamp") or 0), kind == "stderr")
    if kind == "result":
        r = Result(is_main_result=bool(data.get("is_main_result")), extra=data.get("extra"),
                   **{f: data.get(f) for f in FORMATS})
        execution.results.append(r)
        return "result", r
    if kind == "error":
        execution.error = ExecutionError(str(data.get("name", "")), str(data.get("value", "")),
                                         str(data.get("traceback", "")))
        return "error", execution.error
    if kind == "number_of_executions":
        execution.execution_count = data.get("execution_count")
    return None
