"""The guest's boundaries, read from the sources: no VM, no server.

- The agent's table of operations (``hangar.guest.ops.OPS``) and the ops the
  host sends are one list: an op the host sends that the guest lacks fails
  every call with ``invalid``, and an op the guest serves that no host code
  sends is dead code in every sandbox.
- What runs in the guest imports only the standard library and
  ``hangar.guest`` (and ``hangar`` itself, the package root the initramfs
  carries for ``__version__``), and every module it imports travels in the
  initramfs (``hangar.images.initramfs.guest_sources``).
- Each guest path is spelled once, in ``hangar.guest.paths``.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import hangar
from hangar.guest import paths
from hangar.guest.ops import OPS
from hangar.images.initramfs import guest_sources

PKG = Path(hangar.__file__).resolve().parent
GUEST = PKG / "guest"
GUEST_FILES = PKG / "images" / "files"
"""Programs an image recipe writes into the guest (``hangar.images.recipes``)."""


def host_modules() -> Iterator[tuple[Path, ast.Module]]:
    """Every module of ``hangar`` that runs on the host (all but ``hangar/guest``, and the
    programs an image recipe writes into the guest, ``hangar/images/files``: the code
    interpreter's server speaks to its own kernels, not to the agent)."""
    for path in sorted(PKG.rglob("*.py")):
        if GUEST in path.parents or GUEST_FILES in path.parents or "__pycache__" in path.parts:
            continue
        yield path, ast.parse(path.read_text(), str(path))


def guest_modules() -> Iterator[tuple[Path, ast.Module]]:
    for path in sorted(GUEST.rglob("*.py")):
        if "__pycache__" not in path.parts:
            yield path, ast.parse(path.read_text(), str(path))


def strings(node: ast.AST) -> list[str]:
    """The string literals of a tuple, list or set literal (else none)."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant)
                and isinstance(e.value, str)]
    return []


def names_op(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "op"
            or isinstance(node, ast.Attribute) and node.attr == "op")


def host_ops() -> dict[str, list[str]]:
    """The op names the host sends, each with where: ``{"op": "exec", ...}`` dict literals,
    ``<agent>.call("set_time", ...)`` (``self.call`` in the agent client's typed methods),
    ``op="..."`` keywords, and ``op in ("stat", ...)``
    checks of the names a host module passes on to ``call``."""
    found: dict[str, list[str]] = {}

    def add(name: str, path: Path, node: ast.expr | ast.stmt) -> None:
        found.setdefault(name, []).append(f"{path.relative_to(PKG)}:{node.lineno}")

    for path, tree in host_modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Dict):
                for k, v in zip(node.keys, node.values):
                    if (isinstance(k, ast.Constant) and k.value == "op"
                            and isinstance(v, ast.Constant) and isinstance(v.value, str)):
                        add(v.value, path, node)
            elif isinstance(node, ast.Call):
                f = node.func
                caller = ast.unparse(f.value) if isinstance(f, ast.Attribute) else ""
                if (isinstance(f, ast.Attribute) and f.attr == "call"
                        and ("agent" in caller.lower()  # the agent client's own methods:
                             or (caller == "self" and "agent_client" in path.parts))
                        and node.args
                        and isinstance(node.args[0], ast.Constant)
                        and isinstance(node.args[0].value, str)):
                    add(node.args[0].value, path, node)
                for kw in node.keywords:
                    if (kw.arg == "op" and isinstance(kw.value, ast.Constant)
                            and isinstance(kw.value.value, str)):
                        add(kw.value.value, path, node)
            elif isinstance(node, ast.Compare) and names_op(node.left):
                if all(isinstance(o, (ast.In, ast.NotIn)) for o in node.ops):
                    for c in node.comparators:
                        for name in strings(c):
                            add(name, path, node)
    return found


def helper_ops() -> set[str]:
    """The requests of the root helper (``hangar.privileged.protocol``): another protocol
    whose requests are dicts with an ``op`` too."""
    from typing import get_args

    from hangar.privileged import protocol

    union = get_args(get_args(protocol.Request)[0])
    return {get_args(m.model_fields["op"].annotation)[0] for m in union}


def test_the_guests_table_and_the_hosts_ops_are_one_list() -> None:
    helper = helper_ops()
    assert not helper & set(OPS), "the root helper's requests and the guest's ops differ"
    sent = {op: where for op, where in host_ops().items() if op not in helper}
    served = set(OPS)
    missing = {op: where for op, where in sent.items() if op not in served}
    assert not missing, f"the host sends ops the guest does not serve: {missing}"
    unsent = served - set(sent)
    assert not unsent, (f"the guest serves ops no host module sends: {sorted(unsent)} "
                        "(tests/test_guest_ops.py host_ops says where it looks)")
    assert served == {"hello", "exec", "read_file", "write_file", "list_dir", "stat", "mkdir",
                      "remove", "connect", "pty", "watch", "set_time", "reseed", "identity",
                      "proc_start", "proc_list", "proc_attach", "proc_input",
                      "proc_close_stdin", "proc_signal", "proc_resize", "proc_remove"}


def test_every_op_is_a_coroutine_taking_agent_meta_channel() -> None:
    for name, handler in OPS.items():
        assert asyncio.iscoroutinefunction(handler), name
        assert list(inspect.signature(handler).parameters) == ["agent", "meta", "ch"], name
        assert handler.__module__.startswith("hangar.guest.ops."), name
        assert handler.__doc__, f"{name} has no docstring"


def imports(tree: ast.Module, module: str) -> Iterator[tuple[str, int]]:
    """(absolute module name, line) of every import in ``tree``, those inside functions and
    ``TYPE_CHECKING`` blocks included; ``from X import y`` counts as X and X.y."""
    package = module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                up = parts[: len(parts) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            if base == "__future__":
                continue
            yield base, node.lineno
            for a in node.names:
                yield f"{base}.{a.name}", node.lineno


def test_the_guest_imports_only_the_standard_library_and_itself() -> None:
    carried = {rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
               for rel in guest_sources()}
    assert "hangar.guest.ops" in carried and "hangar.guest.transports" in carried
    stdlib = sys.stdlib_module_names
    bad: list[str] = []
    for path, tree in guest_modules():
        rel = path.relative_to(PKG.parent).with_suffix("")
        module = ".".join(rel.parts).removesuffix(".__init__")
        for name, line in imports(tree, module):
            top = name.split(".")[0]
            where = f"{path.relative_to(PKG)}:{line}"
            if top in stdlib:
                continue
            if top != "hangar":
                bad.append(f"{where}: {name} (neither the standard library nor hangar.guest)")
            elif name == "hangar" or name == "hangar.__version__":
                continue  # the package root, which the initramfs carries (guest_sources)
            elif not (name == "hangar.guest" or name.startswith("hangar.guest.")):
                bad.append(f"{where}: {name} is host code; the guest has only hangar.guest")
            elif name not in carried and name.rpartition(".")[0] not in carried:
                bad.append(f"{where}: {name} is not carried into the initramfs")
    assert not bad, "\n".join(bad)


def test_the_guest_package_imports_alone_in_a_bare_interpreter(tmp_path: Path) -> None:
    """The carried files, and nothing else of hangar, run the agent's imports (``-S``: no
    site-packages either, as in the guest)."""
    import subprocess

    for rel, data in guest_sources().items():
        dest = tmp_path / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
    code = ("import sys; sys.path[0] = sys.argv[1]; import hangar.guest.agent as a, "
            "hangar.guest.init, hangar.guest.desktop, hangar.guest.net; "
            "assert all(m == 'hangar' or m.startswith('hangar.guest') "
            "for m in sys.modules if m.startswith('hangar')); print(len(a.OPS))")
    out = subprocess.run([sys.executable, "-S", "-c", code, str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(len(OPS))


GUEST_ROOTS = ("/run/hangar", "/usr/lib/hangar", "/etc/hangar/env.json")
_GUEST_ROOT = re.compile("(?:" + "|".join(map(re.escape, GUEST_ROOTS)) + r")(?![\w.-])")
"""A guest root as a whole name (the host's own ``/run/hangar-builds`` is not one)."""


def docstrings(tree: ast.Module) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
        # an attribute's docstring: a string statement after an assignment
        for field in ("body", "orelse"):
            stmts = getattr(node, field, None)
            if isinstance(stmts, list):
                for a, b in zip(stmts, stmts[1:]):
                    if (isinstance(a, (ast.Assign, ast.AnnAssign)) and isinstance(b, ast.Expr)
                            and isinstance(b.value, ast.Constant)):
                        ids.add(id(b.value))
    return ids


def test_each_guest_path_is_spelled_once_in_hangar_guest_paths() -> None:
    spelled: list[str] = []
    for path, tree in [*host_modules(), *guest_modules()]:
        if path == GUEST / "paths.py":
            continue
        docs = docstrings(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and id(node) not in docs and _GUEST_ROOT.search(node.value)):
                spelled.append(f"{path.relative_to(PKG)}:{node.lineno}: {node.value[:60]!r}")
    assert not spelled, "guest paths spelled outside hangar.guest.paths:\n" + "\n".join(spelled)
    assert paths.BOOT_MARKS.startswith(paths.RUN_DIR + "/")
    assert paths.DESKTOP_READY.startswith(paths.RUN_DIR + "/")
