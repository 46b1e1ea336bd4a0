"""Bounds in one place: each bound that several places check is named once, in
``hangar.schemas.bounds``, and imported wherever it is checked.

The check reads the source (no import): a literal equal to one of those bounds where
a bound is checked (a ``ge=``/``le=``/``gt=``/``lt=``/``min=``/``max=`` argument, a JSON
schema's ``minimum``/``maximum``, a template file's ``number(key, low, high)``, or a
comparison with a port's limit) is a second spelling. A literal counts where the
statement that checks it names what it bounds (``memory`` for 65536, ``port`` for
65535), so a buffer of 64 KiB is no memory bound. Checked: the host's packages that
these bounds concern. Not checked: ``hangar.guest`` (it runs in the guest image
and imports nothing of the host's), and ``hangar.net``, ``hangar.privileged``,
``hangar.cluster`` and ``hangar.ops``, whose own port checks are theirs.
"""

from __future__ import annotations

import ast
import operator
from pathlib import Path

from hangar.schemas import bounds

SRC = Path(__file__).resolve().parent.parent / "src" / "hangar"
CHECKED = ("api", "cli", "client", "core", "engines", "images", "schemas", "tools",
           "config.py", "server.py")

NAMED = [
    (bounds.VCPUS_MAX, "VCPUS_MAX", ("vcpu",)),
    (bounds.MEMORY_MIB_MIN, "MEMORY_MIB_MIN", ("memory",)),
    (bounds.MEMORY_MIB_MAX, "MEMORY_MIB_MAX", ("memory",)),
    (bounds.DISK_MIB_MIN, "DISK_MIB_MIN", ("disk",)),
    (bounds.DISK_MIB_MAX, "DISK_MIB_MAX", ("disk",)),
    (bounds.TTL_MAX_S, "TTL_MAX_S", ("timeout", "ttl")),
    (bounds.EXEC_TIMEOUT_MAX_S, "EXEC_TIMEOUT_MAX_S", ("timeout", "exec_max")),
    (bounds.PORT_MAX, "PORT_MAX", ("port",)),
    (bounds.PORT_MAX + 1, "PORT_MAX", ("port",)),
]
"""(value, its name, words one of which the statement that checks it holds). A bound's
minimum of 1 (``VCPUS_MIN``, ``PORT_MIN``) is too common a number to tell apart."""
KEYWORDS = {"ge", "le", "gt", "lt", "min", "max"}
SCHEMA_KEYS = {"minimum", "maximum"}
ARITHMETIC = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.LShift: operator.lshift}
COMPOUND = (ast.If, ast.While, ast.For, ast.AsyncFor, ast.With, ast.AsyncWith, ast.Try,
            ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Match)


def _value(node: ast.AST) -> float | None:
    """A constant number, or an arithmetic expression of constants (``30 * 86400``)."""
    if isinstance(node, ast.Constant):
        v = node.value
        return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None
    if isinstance(node, ast.BinOp) and type(node.op) in ARITHMETIC:
        left, right = _value(node.left), _value(node.right)
        if left is not None and right is not None:
            return ARITHMETIC[type(node.op)](left, right)
    return None


def spellings(source: str) -> list[tuple[int, float]]:
    """(line, value) of each literal bound in ``source`` (see the module docstring): a
    literal equal to a bound's value where a bound is checked, in a statement (or an
    ``if``/``while`` test) that names what that bound bounds."""
    found: set[tuple[int, float]] = set()
    for stmt in ast.walk(ast.parse(source)):
        if not isinstance(stmt, ast.stmt):
            continue
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = stmt.args  # a parameter's annotation: typer.Option(min=..., max=...)
            scopes = [*a.posonlyargs, *a.args, *a.kwonlyargs]
        elif isinstance(stmt, COMPOUND):
            scopes = [stmt.test] if isinstance(stmt, (ast.If, ast.While)) else []
        else:
            scopes = [stmt]
        for scope in scopes:
            text = ""
            for node in ast.walk(scope):
                candidates: list[ast.AST] = []
                if isinstance(node, ast.Call):
                    candidates += [kw.value for kw in node.keywords if kw.arg in KEYWORDS]
                    if isinstance(node.func, ast.Attribute) and node.func.attr == "number":
                        candidates += node.args[1:3]
                elif isinstance(node, ast.Dict):
                    candidates += [v for k, v in zip(node.keys, node.values)
                                   if isinstance(k, ast.Constant) and k.value in SCHEMA_KEYS]
                elif isinstance(node, ast.Compare):
                    candidates += [node.left, *node.comparators]
                elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                    candidates.append(node.value)  # a second name: MAX_TTL_S = 30 * 86400
                for c in candidates:
                    v = _value(c)
                    if v is None or not any(v == value for value, _, _ in NAMED):
                        continue
                    text = text or (ast.get_source_segment(source, scope) or "").lower()
                    if any(v == value and any(w in text for w in words)
                           for value, _, words in NAMED):
                        found.add((c.lineno, v))
    return sorted(found)


def test_the_checker_sees_each_spelling() -> None:
    source = ("memory_mib = Field(None, ge=128, le=65536)\n"
              "timeout: float = Field(None, le=30 * 86400)\n"
              "vcpus = r.number('vcpus', 1, 32)\n"
              "if not 0 < int(raw_port) < 65536:\n"
              "    exec_timeout = {'type': 'number', 'maximum': 86400}\n"
              "memory = Field(65536, ge=MEMORY_MIB_MIN, max_length=32)\n"
              "signalled = rc > 128\n"
              "if len(err) < 65536 and disk_full:\n"
              "    vmm_overhead_mib = Field(192, ge=32)\n"
              "MAX_TOKEN_TTL_S = 30 * 86400\n"
              "MAX_LINE = 65536\n"
              "def bench(memory_mib: Annotated[int, Option(min=128)] = 512) -> None:\n"
              "    pass\n")
    assert spellings(source) == [(1, 128), (1, 65536), (2, 2592000), (3, 32), (4, 65536),
                                 (5, 86400), (10, 2592000), (12, 128)]


def test_no_bound_is_spelled_twice() -> None:
    """Each of ``bounds``' numeric bounds is spelled once, in ``hangar.schemas.bounds``."""
    found = []
    for entry in CHECKED:
        root = SRC / entry
        for path in sorted(root.rglob("*.py") if root.is_dir() else [root]):
            rel = path.relative_to(SRC).as_posix()
            if rel == "schemas/bounds.py":
                continue
            for line, value in spellings(path.read_text()):
                names = {n for v, n, _ in NAMED if v == value}
                found.append(f"{rel}:{line}: {value:g} ({', '.join(sorted(names))})")
    assert found == []


def test_the_bounds_are_what_the_api_promises() -> None:
    """The figures the docs and the OpenAPI descriptions give."""
    assert (bounds.VCPUS_MIN, bounds.VCPUS_MAX) == (1, 32)
    assert (bounds.MEMORY_MIB_MIN, bounds.MEMORY_MIB_MAX) == (128, 65536)
    assert (bounds.DISK_MIB_MIN, bounds.DISK_MIB_MAX) == (512, 1 << 20)
    assert bounds.TTL_MAX_S == 30 * 24 * 3600
    assert bounds.EXEC_TIMEOUT_MAX_S == 24 * 3600
    assert (bounds.PORT_MIN, bounds.PORT_MAX) == (1, 65535)


def test_an_exec_without_a_timeout_gets_the_longest_a_command_may_run() -> None:
    from hangar.engines.agent_client import Deadlines

    assert Deadlines().exec_max_s == bounds.EXEC_TIMEOUT_MAX_S
