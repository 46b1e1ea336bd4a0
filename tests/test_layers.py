"""The layers' arrows, checked on the source: which package may import which.

Every ``import`` and ``from ... import`` of a module counts, at any depth
(inside functions too, where a lazy import would hide an arrow), relative
ones resolved against the module's package. See docs/architecture.md.
"""

from __future__ import annotations

import ast
from pathlib import Path


SRC = Path(__file__).resolve().parent.parent / "src"


def modules(package: str, src: Path) -> list[Path]:
    """The source files of ``package`` (``hangar.api`` → src/hangar/api/**/*.py)."""
    root = src.joinpath(*package.split("."))
    files = sorted(root.rglob("*.py"))
    assert files, f"no sources under {root}"
    return files


def module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, src: Path) -> set[str]:
    """Absolute names of the modules ``path`` imports (``from a import b`` counts ``a`` and
    ``a.b``, since ``b`` may be a module)."""
    name = module_name(path, src)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            found.add(prefix)
            found |= {f"{prefix}.{a.name}" for a in node.names}
    return found


def offending(package: str, forbidden: tuple[str, ...],
              src: Path = SRC) -> dict[str, list[str]]:
    """{module: [the forbidden modules it imports]} for every module of ``package``."""
    out: dict[str, list[str]] = {}
    for path in modules(package, src):
        bad = sorted(m for m in imports(path, src)
                     if any(m == f or m.startswith(f + ".") for f in forbidden))
        if bad:
            out[module_name(path, src)] = bad
    return out


def test_the_checker_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    """A check that cannot fail proves nothing: feed it the imports it must catch."""
    pkg = tmp_path / "hangar" / "api"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    probe = pkg / "probe.py"
    probe.write_text("def f():\n    from ..engines import qemu\n    import hangar.net.nft\n")
    assert offending("hangar.api", ("hangar.engines", "hangar.net"), tmp_path) == {
        "hangar.api.probe": ["hangar.engines", "hangar.engines.qemu", "hangar.net.nft"]}


def test_api_imports_nothing_below_core() -> None:
    """api/ turns HTTP into calls on core/ and back: it never reaches the engines, the
    guest's code, image builds or the host's network itself."""
    bad = offending("hangar.api", ("hangar.engines", "hangar.guest", "hangar.images",
                                   "hangar.net"))
    assert bad == {}


def test_core_never_imports_the_layers_above_it() -> None:
    bad = offending("hangar.core", ("hangar.api", "hangar.cluster", "hangar.server",
                                    "hangar.cli", "hangar.client", "hangar.tools"))
    assert bad == {}


def test_api_never_imports_the_cluster_or_the_server_assembly() -> None:
    """The cluster's gateway is handed to api/app.py by hangar.server, so api and cluster
    do not import each other through it."""
    assert offending("hangar.api", ("hangar.cluster", "hangar.server", "hangar.cli")) == {}


def test_cluster_never_imports_api() -> None:
    """cluster/ uses core's public surface; the key check lives in hangar.keys."""
    assert offending("hangar.cluster", ("hangar.api",)) == {}


BELOW_THE_HELPER = ("hangar.engines", "hangar.net", "hangar.images", "hangar.core",
                    "hangar.api", "hangar.cluster", "hangar.guest", "hangar.privileged")


def test_privileged_is_the_bottom() -> None:
    """``hangar.privileged`` (the root helper's protocol and client) is what the engines
    and the network are handed; it imports none of the packages that use it, so no
    package imports its way back through it (the helper itself is ``hangar.roothelper``,
    beside the server)."""
    bad = offending("hangar.privileged", ("hangar.engines", "hangar.net", "hangar.images",
                                          "hangar.core", "hangar.api", "hangar.cluster",
                                          "hangar.guest", "hangar.server", "hangar.cli",
                                          "hangar.roothelper", "hangar.client",
                                          "hangar.tools"))
    assert bad == {}


def test_nothing_below_the_server_imports_the_root_helper() -> None:
    """The root helper drives the engines and the network: only the server's assembly
    (``hangar.cli.serve``) forks it."""
    bad: dict[str, list[str]] = {}
    for package in BELOW_THE_HELPER:
        bad |= offending(package, ("hangar.roothelper", "hangar.server", "hangar.cli"))
    assert bad == {}


def privileged_ops() -> set[str]:
    """The ops of the root helper's request table (``hangar.privileged.protocol``)."""
    from typing import get_args

    from hangar.privileged import protocol

    union = get_args(get_args(protocol.Request)[0])
    return {get_args(m.model_fields["op"].annotation)[0] for m in union}


def op_literals(path: Path) -> list[tuple[int, object]]:
    """(line, value) of every ``"op"`` a dict literal or ``dict(op=...)`` in ``path`` spells
    (the value when it is a constant, else None)."""
    found: list[tuple[int, object]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and key.value == "op":
                    found.append((node.lineno, value.value if isinstance(value, ast.Constant)
                                  else None))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "dict"):
            for kw in node.keywords:
                if kw.arg == "op":
                    found.append((node.lineno, kw.value.value if isinstance(
                        kw.value, ast.Constant) else None))
    return found


def test_the_op_finder_sees_literals_and_dict_calls(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text('a = {"op": "kill_vmm", "pid": 2}\nb = dict(op="net_info")\n'
                     'c = {"op": name}\nd = {"other": "op"}\n')
    assert op_literals(probe) == [(1, "kill_vmm"), (2, "net_info"), (3, None)]


def test_only_privileged_spells_a_privileged_request() -> None:
    """Every request to the root helper goes through a typed method of
    ``hangar.privileged.Client``: no module outside ``hangar.privileged`` writes one as
    an ``{"op": ...}`` dict (the guest's own protocol, whose requests are dicts with an
    ``op`` too, is another table and another check)."""
    ops = privileged_ops()
    root = SRC / "hangar"
    bad = {module_name(p, SRC): [line for line, op in op_literals(p) if op in ops]
           for p in sorted(root.rglob("*.py"))
           if not p.is_relative_to(root / "privileged")}
    assert {m: lines for m, lines in bad.items() if lines} == {}


def test_net_spells_no_op_dict_at_all() -> None:
    """The network manager forwards to the root helper through its typed client and
    speaks to no guest: no ``"op"`` dict anywhere in ``hangar.net``."""
    bad = {module_name(p, SRC): op_literals(p) for p in modules("hangar.net", SRC)}
    assert {m: found for m, found in bad.items() if found} == {}


def raw_guest_requests(package: str, src: Path = SRC) -> dict[str, list[int]]:
    """{module: [lines]} of guest requests written by hand in ``package``: a dict literal
    with an ``"op"`` key, a ``dict(op=...)``, or a ``.call("<guest operation>", ...)``.
    The agent client's typed methods (``hangar.engines.agent_client``) make them."""
    from hangar.guest.ops import OPS

    out: dict[str, list[int]] = {}
    for path in modules(package, src):
        lines = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Dict) and any(
                    isinstance(k, ast.Constant) and k.value == "op" for k in node.keys):
                lines.append(node.lineno)
            elif isinstance(node, ast.Call) and (
                    (isinstance(node.func, ast.Name) and node.func.id == "dict"
                     and any(kw.arg == "op" for kw in node.keywords))
                    or (isinstance(node.func, ast.Attribute) and node.func.attr == "call"
                        and node.args and isinstance(node.args[0], ast.Constant)
                        and node.args[0].value in OPS)):
                lines.append(node.lineno)
        if lines:
            out[module_name(path, src)] = sorted(lines)
    return out


def test_the_guest_request_checker_sees_each_form(tmp_path: Path) -> None:
    pkg = tmp_path / "hangar" / "core"
    pkg.mkdir(parents=True)
    (pkg / "probe.py").write_text(
        'A = {"op": "exec", "argv": ["true"]}\n'
        'B = dict(op="stat", path="/")\n'
        'async def f(agent):\n'
        '    await agent.call("hello")\n'
        '    await agent.ping()\n'
        '    return {"call": "op"}, {**A}\n')
    assert raw_guest_requests("hangar.core", tmp_path) == {"hangar.core.probe": [1, 2, 4]}


def test_core_and_api_make_guest_requests_only_through_the_typed_client() -> None:
    """Core calls the agent client's typed methods (one per guest operation) and builds
    exec and process requests with its builders (``exec_meta``, ``proc_meta``); api
    knows no guest operation at all."""
    assert raw_guest_requests("hangar.core") == {}
    assert raw_guest_requests("hangar.api") == {}
