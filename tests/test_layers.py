"""The layers' arrows, checked on the source: which package may import which.

Every ``import`` and ``from ... import`` of a module counts, at any depth
(inside functions too, where a lazy import would hide an arrow), relative
ones resolved against the module's package. See docs/architecture.md.
"""

from __future__ import annotations

import ast
import re
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


THE_SERVER = ("hangar.api", "hangar.core", "hangar.engines", "hangar.guest", "hangar.images",
              "hangar.net", "hangar.cluster", "hangar.privileged", "hangar.server",
              "hangar.roothelper")
"""The server's packages: what ``pip install hangar`` (the SDK) does not need."""


def test_the_sdk_imports_neither_the_cli_nor_the_server() -> None:
    """``hangar.client`` is the SDK: the CLI and the agent tools import it, never the
    reverse, and it runs without the server's packages."""
    assert offending("hangar.client", ("hangar.cli", "hangar.tools") + THE_SERVER) == {}


def test_what_the_sdk_and_the_cli_share_imports_neither() -> None:
    """The Dockerfile build (``hangar.dockerfile``) and the COPY archives
    (``hangar.build_archive``) sit under the SDK and the CLI, which both call them, and
    import neither, nor the server (whose core checks the archives too)."""
    bad: dict[str, list[str]] = {}
    for module in ("dockerfile", "build_archive"):
        path = SRC / "hangar" / f"{module}.py"
        found = sorted(m for m in imports(path, SRC)
                       if m.split(".")[:2] != ["hangar", "errors"] and m.startswith("hangar"))
        if found:
            bad[f"hangar.{module}"] = found
    assert bad == {}


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


# -- core's face (hangar.core.service) --------------------------------------------------

FACE = ("hangar.core.service", "hangar.core.views")
"""The only modules of core that api and cluster import."""


def beyond_the_face(package: str, src: Path = SRC) -> dict[str, list[str]]:
    """{module: [the modules of core other than ``FACE`` it imports]} for ``package``."""
    out: dict[str, list[str]] = {}
    for path in modules(package, src):
        bad = sorted(m for m in imports(path, src)
                     if m.startswith("hangar.core.")
                     and not any(m == f or m.startswith(f + ".") for f in FACE))
        if bad:
            out[module_name(path, src)] = bad
    return out


def test_api_and_cluster_import_only_cores_face() -> None:
    """api and cluster see core through ``hangar.core.service`` (and its views) only."""
    assert beyond_the_face("hangar.api") == {}
    assert beyond_the_face("hangar.cluster") == {}


def test_the_face_check_sees_a_core_module(tmp_path: Path) -> None:
    pkg = tmp_path / "hangar" / "api"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "probe.py").write_text("from hangar.core.service import State\n"
                                  "def f():\n    from ..core import store\n")
    assert beyond_the_face("hangar.api", tmp_path) == {"hangar.api.probe": ["hangar.core.store"]}


def row_names() -> set[str]:
    """The class names of core's ORM rows (every class mapped on the store's ``Base``)."""
    import hangar.core.service  # noqa: F401  (imports every module that maps a row)
    from hangar.core.store import Base

    return {m.class_.__name__ for m in Base.registry.mappers}


def naming_rows(package: str, names: set[str], src: Path = SRC) -> dict[str, list[str]]:
    """{module: [the row names its text mentions]} (code, comments and docstrings)."""
    out: dict[str, list[str]] = {}
    for path in modules(package, src):
        words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", path.read_text()))
        if bad := sorted(words & names):
            out[module_name(path, src)] = bad
    return out


def test_no_row_of_core_reaches_api_or_cluster(tmp_path: Path) -> None:
    """Core answers with frozen views (``hangar.core.views``), never its ORM rows."""
    names = row_names()
    assert {"SandboxRecord", "SnapshotRecord", "VolumeRecord", "SecretRecord"} <= names
    assert naming_rows("hangar.api", names) == {}
    assert naming_rows("hangar.cluster", names) == {}
    pkg = tmp_path / "hangar" / "cluster"
    pkg.mkdir(parents=True)
    (pkg / "probe.py").write_text("def f(rec: 'SandboxRecord') -> None: ...\n")
    assert naming_rows("hangar.cluster", names, tmp_path) == {
        "hangar.cluster.probe": ["SandboxRecord"]}


SERVICE_TYPES = {"SandboxManager", "SandboxService", "Manager"}
"""Names whose presence in an annotation marks the sandbox service (``Manager`` is the
routes' ``Annotated[SandboxManager, Depends(manager)]``)."""
SERVICE_ATTRS = {"manager"}
"""An attribute or parameter of this name holds the service (``request.app.state.manager``,
``env.manager``, ``self.manager``, ``def f(manager: Any)``)."""


def _mentions_service(annotation: ast.expr | None) -> bool:
    if annotation is None:
        return False
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return bool(set(re.findall(r"\w+", annotation.value)) & SERVICE_TYPES)
    return any(isinstance(n, ast.Name) and n.id in SERVICE_TYPES
               or isinstance(n, ast.Attribute) and n.attr in SERVICE_TYPES
               for n in ast.walk(annotation))


class _Chains(ast.NodeVisitor):
    """Every attribute chain from the service in one module: ``(line, [names...])``."""

    def __init__(self) -> None:
        self.chains: list[tuple[int, list[str]]] = []
        self.names: list[set[str]] = [set()]
        self.self_attrs: list[set[str]] = [set()]

    def is_service(self, node: ast.expr) -> bool:
        if isinstance(node, ast.Name):
            return any(node.id in scope for scope in self.names)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "getattr" and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant) and node.args[1].value in SERVICE_ATTRS):
            return True  # getattr(state, "manager", None)
        if isinstance(node, ast.Attribute):
            if node.attr in SERVICE_ATTRS:
                return True
            return (isinstance(node.value, ast.Name) and node.value.id == "self"
                    and node.attr in self.self_attrs[-1])
        return False

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        """``self.<name>`` holds the service in this class when the class annotates
        ``<name>`` with it, or a method sets it from the service (``self.m = manager``)."""
        held = {n.target.id for n in node.body
                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
                and _mentions_service(n.annotation)}
        for f in node.body:
            if not isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            args = f.args.posonlyargs + f.args.args + f.args.kwonlyargs
            params = {a.arg for a in args
                      if _mentions_service(a.annotation) or a.arg in SERVICE_ATTRS}
            for n in ast.walk(f):
                if isinstance(n, ast.Assign):
                    targets, value, note = n.targets, n.value, None
                elif isinstance(n, ast.AnnAssign):
                    targets, value, note = [n.target], n.value, n.annotation
                else:
                    continue
                from_service = (_mentions_service(note)
                                or isinstance(value, ast.Name) and value.id in params
                                or isinstance(value, ast.Attribute)
                                and value.attr in SERVICE_ATTRS)
                held |= {t.attr for t in targets if from_service
                         and isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                         and t.value.id == "self"}
        self.self_attrs.append(held)
        self.generic_visit(node)
        self.self_attrs.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
        self.names.append({a.arg for a in args
                           if _mentions_service(a.annotation) or a.arg in SERVICE_ATTRS})
        self.generic_visit(node)
        self.names.pop()

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_Assign(self, node: ast.Assign) -> None:
        self.visit(node.value)
        if self.is_service(node.value):
            self.names[-1] |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        for t in node.targets:
            self.visit(t)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)
        if isinstance(node.target, ast.Name) and (
                _mentions_service(node.annotation)
                or node.value is not None and self.is_service(node.value)):
            self.names[-1].add(node.target.id)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain: list[str] = []
        cur: ast.expr = node
        while isinstance(cur, ast.Attribute) and not self.is_service(cur):
            chain.append(cur.attr)
            cur = cur.value
        if chain and self.is_service(cur):
            self.chains.append((node.lineno, chain[::-1]))
            return  # the inner links are this chain's prefix
        self.generic_visit(node)


def service_chains(path: Path) -> list[tuple[int, list[str]]]:
    """Attribute chains from the sandbox service in ``path``: ``m.ports.expose(...)`` is
    ``["ports", "expose"]``; ``m.get(x).state`` is ``["get"]`` (a call ends the chain)."""
    v = _Chains()
    v.visit(ast.parse(path.read_text(), str(path)))
    return v.chains


def surface_names(cls: type) -> set[str]:
    """The public names of a sub-surface type: its methods and properties, and the fields
    of a pydantic model (``Settings``)."""
    names = {n for n in dir(cls) if not n.startswith("_")}
    return names | set(getattr(cls, "model_fields", {}))


def reaching_through(package: str, src: Path = SRC) -> tuple[int, list[str]]:
    """(chains checked, ``module:line m.a.b`` of each that leaves the face)."""
    from hangar.core.service import SURFACE_TYPES, SandboxService

    bad: list[str] = []
    n = 0
    for path in modules(package, src):
        for line, chain in service_chains(path):
            n += 1
            first, rest = chain[0], chain[1:]
            ok = first in SandboxService.PUBLIC and (
                not rest or first in SURFACE_TYPES
                and rest[0] in surface_names(SURFACE_TYPES[first]))
            if not ok:
                bad.append(f"{module_name(path, src)}:{line} m.{'.'.join(chain)}")
    return n, bad


def test_api_and_cluster_use_only_the_faces_names() -> None:
    """From the service, api and cluster use only ``SandboxService.PUBLIC`` and, on a
    sub-surface (``SURFACES``), its public verbs: ``m.ports.expose(...)``, never
    ``m.launcher.rules.change(...)`` or ``m.store.get(...)``."""
    seen_api, bad_api = reaching_through("hangar.api")
    seen_cluster, bad_cluster = reaching_through("hangar.cluster")
    assert bad_api == [] and bad_cluster == []
    # the checker found the service where it is used (a blind checker passes everything)
    assert seen_api > 100 and seen_cluster > 15, (seen_api, seen_cluster)


def test_the_face_check_sees_every_way_to_the_service(tmp_path: Path) -> None:
    pkg = tmp_path / "hangar" / "api"
    pkg.mkdir(parents=True)
    (pkg / "probe.py").write_text(
        "async def route(m: Manager, request):\n"
        "    m.ports.expose('s', 80, False)\n"          # a sub-surface's verb: allowed
        "    await m.launcher.rules.change('s')\n"       # a part behind the face
        "    m.volumes.holders('v')\n"                   # not a verb of the surface
        "    mgr = getattr(request.app.state, 'manager', None)\n"
        "    mgr.store.get('s')\n"
        "    m.get('s').state\n"                         # a view's field: allowed
        "class Proxy:\n"
        "    def __init__(self, manager: 'SandboxManager | None') -> None:\n"
        "        self.m = manager\n"
        "    async def go(self, env):\n"
        "        self.m.calls.tunnel('s', 80)\n"
        "        manager = request.app.state.manager\n"
        "        manager.launcher.volumes\n"
        "        env.manager.registry.get('s')\n"
        "        self.m.settings.domain\n"               # settings' field: allowed
        "def untyped(manager):\n"
        "    return manager.pool.status()\n")
    seen, bad = reaching_through("hangar.api", tmp_path)
    assert seen == 10
    assert bad == ["hangar.api.probe:3 m.launcher.rules.change",
                   "hangar.api.probe:4 m.volumes.holders",
                   "hangar.api.probe:6 m.store.get",
                   "hangar.api.probe:12 m.calls.tunnel",
                   "hangar.api.probe:14 m.launcher.volumes",
                   "hangar.api.probe:15 m.registry.get",
                   "hangar.api.probe:18 m.pool.status"]


def test_every_public_name_of_the_face_exists() -> None:
    """``PUBLIC`` and ``SURFACE_TYPES`` name only what the service has: a method, a
    property, or an attribute its ``__init__`` sets."""
    import inspect

    from hangar.core.service import SURFACE_TYPES, SandboxService

    init = inspect.getsource(SandboxService.__init__)
    has = set(dir(SandboxService)) | set(re.findall(r"self\.(\w+)(?::[^=\n]*)? = ", init))
    assert sorted(SandboxService.PUBLIC - has) == []
    assert set(SURFACE_TYPES) == set(SandboxService.SURFACES) <= SandboxService.PUBLIC
