"""Every code block of the README and the guides runs, against a real server.

Fenced blocks tagged ``python``, ``sh``, ``bash``, ``shell`` or ``console`` in
README.md and docs/*.md are run in order, one test each, against the suite's
server (conftest's ``server``): the SDK and the CLI find it through
``HANGAR_URL`` and ``HANGAR_API_KEY``, and ``HANGAR_DATA_DIR`` is its data
folder. A ``python`` block runs as a program; a ``sh`` block as a bash script
with ``set -euo pipefail``; of a ``console`` block only the ``$ `` lines run (the
rest is output). ``hangar`` on the PATH is this checkout's CLI, and each
document's blocks share a working folder that looks like a checkout (its
top-level entries, and ``.venv`` for the interpreter running the tests), so
``.venv/bin/python examples/...`` works there and files a block writes stay
there.

Fence options after the language:

- ``norun``: not run here (an install as root, a production host, a cluster);
  the block's first line is a ``#`` comment that tells the reader why.
- ``file=NAME`` (any language): the block is written to ``NAME`` in the
  working folder before the document's blocks run, for a later block to use.

A block must leave nothing behind: a sandbox, machine or snapshot it made
and did not delete fails its test (and is deleted).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from conftest import SHARED, SRC, Server

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = {"python", "sh", "bash", "shell", "console"}
FENCE = re.compile(r"^( {0,4})```(.*)$")
BLOCK_TIMEOUT = 900
"""Seconds one block may take: a desktop's cold boot under TCG on a busy 2-core host."""


@dataclass
class Block:
    doc: Path
    line: int
    lang: str
    flags: set[str]
    options: dict[str, str]
    text: str

    @property
    def name(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.lang in RUN and "norun" not in self.flags

    def script(self) -> str:
        """What bash runs for a shell block: the text, or a console block's commands."""
        if self.lang != "console":
            return self.text
        out: list[str] = []
        continued = False
        for line in self.text.splitlines():
            if continued or line.startswith("$ "):
                out.append(line if continued else line[2:])
                continued = line.endswith("\\")
        return "\n".join(out) + "\n"


def blocks(doc: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, in order (a fence may be indented, in a list)."""
    found: list[Block] = []
    lines = doc.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, words = m.group(1), m.group(2).split()
        start = i
        i += 1
        body: list[str] = []
        while i < len(lines) and lines[i] != indent + "```":
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        assert i < len(lines), f"{doc}:{start + 1}: the block never ends"
        i += 1
        lang = words[0] if words else ""
        rest = words[1:]
        found.append(Block(doc, start + 1, lang, {w for w in rest if "=" not in w},
                           dict(w.split("=", 1) for w in rest if "=" in w),
                           "\n".join(body) + "\n"))
    return found


ALL = [b for doc in DOCS for b in blocks(doc)]


# -- checks that need no server ---------------------------------------------------------------


def test_the_readme_is_short_and_indexes_every_guide() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 150
    for doc in DOCS[1:]:
        assert f"(docs/{doc.name})" in readme, f"the README's index lacks docs/{doc.name}"


def test_every_block_that_is_not_run_says_why() -> None:
    for b in ALL:
        if b.lang in RUN and "norun" in b.flags:
            first = b.text.lstrip("\n").splitlines()[0] if b.text.strip() else ""
            assert first.startswith("#") and len(first) > 20, (
                f"{b.name}: a norun block starts with a comment saying why it is not run")
        unknown = b.flags - {"norun"}
        assert not unknown, f"{b.name}: unknown fence flags {unknown}"
        assert set(b.options) <= {"file"}, f"{b.name}: unknown fence options {b.options}"


def anchors(doc: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    found = set()
    for line in doc.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def test_every_link_between_the_docs_arrives() -> None:
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            assert dest.exists(), f"{doc.relative_to(ROOT)}: {target} does not exist"
            if anchor and dest.suffix == ".md":
                assert anchor in anchors(dest), f"{doc.relative_to(ROOT)}: no #{anchor} in {path}"


def test_the_blocks_are_found() -> None:
    langs = {b.lang for b in ALL if b.runs}
    assert {"python", "sh", "console"} <= langs
    assert sum(b.runs for b in ALL) >= 20


# -- running them ---------------------------------------------------------------------------


@dataclass
class Workspace:
    """A document's working folder, its PATH and its environment."""

    dir: Path
    env: dict[str, str] = field(default_factory=dict)


def checkout_view(dest: Path) -> None:
    """Make ``dest`` look like this checkout: links to its top-level entries and a .venv."""
    for entry in ROOT.iterdir():
        if entry.name != ".git":
            (dest / entry.name).symlink_to(entry)
    if not (dest / ".venv").exists():
        (dest / ".venv").symlink_to(Path(sys.prefix))
    shim = dest / ".bin"
    shim.mkdir()
    (shim / "hangar").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m hangar.cli "$@"\n')
    (shim / "hangar").chmod(0o755)


@pytest.fixture(scope="module")
def workspaces(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
        dict[Path, Workspace]]:
    made: dict[Path, Workspace] = {}
    for doc in DOCS:
        d = tmp_path_factory.mktemp(f"doc-{doc.stem}")
        checkout_view(d)
        for b in blocks(doc):
            if "file" in b.options:
                (d / b.options["file"]).write_text(b.text)
        env = {k: v for k, v in os.environ.items()
               if k not in ("ANTHROPIC_API_KEY", "OPENAI_API_KEY", "VIRTUAL_ENV")}
        env.update(HANGAR_URL=server.url, HANGAR_API_KEY=server.key,
                   HANGAR_DATA_DIR=str(server.data_dir), PYTHONPATH=str(SRC), COLUMNS="200",
                   PATH=f"{d / '.bin'}:{Path(sys.executable).parent}:{os.environ['PATH']}")
        made[doc] = Workspace(d, env)
    yield made
    for ws in made.values():
        shutil.rmtree(ws.dir, ignore_errors=True)
    # Templates the docs build live in the shared image cache, which only its own data
    # directory may change: forget them there (hangar image gc collects the builds).
    for b in ALL:
        if b.options.get("file", "").endswith(".toml") and "name" in tomllib.loads(b.text):
            subprocess.run([sys.executable, "-m", "hangar.cli", "template", "rm",
                            tomllib.loads(b.text)["name"]], capture_output=True, timeout=120,
                           env={**os.environ, "HANGAR_DATA_DIR": str(SHARED),
                                "PYTHONPATH": str(SRC)})


def holdings(api: httpx.Client) -> dict[str, set[str]]:
    """What the server holds: sandbox ids, machines' users, snapshot ids."""
    return {"sandboxes": {s["id"] for s in api.get("/sandboxes").json()["sandboxes"]},
            "machines": {m["user_id"] for m in api.get("/machines").json()["machines"]},
            "snapshots": {s["id"] for s in api.get("/snapshots").json()["snapshots"]}}


def clear(api: httpx.Client, kind: str, ids: set[str]) -> None:
    for i in ids:
        api.delete(f"/{kind}/{i}")


@pytest.mark.vm
@pytest.mark.timeout(BLOCK_TIMEOUT + 60)
@pytest.mark.parametrize("block", [b for b in ALL if b.runs], ids=lambda b: b.name)
def test_the_block_runs(block: Block, workspaces: dict[Path, Workspace],
                        api: httpx.Client) -> None:
    ws = workspaces[block.doc]
    before = holdings(api)
    if block.lang == "python":
        path = ws.dir / f"block_{block.line}.py"
        path.write_text(block.text)
        argv = [sys.executable, str(path)]
    else:
        path = ws.dir / f"block_{block.line}.sh"
        path.write_text("set -euo pipefail\n" + block.script())
        argv = ["bash", str(path)]
    try:
        r = subprocess.run(argv, cwd=ws.dir, env=ws.env, stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=BLOCK_TIMEOUT)
    finally:
        after = holdings(api)
        left = {k: after[k] - before[k] for k in after}
        clear(api, "sandboxes", left["sandboxes"])
        clear(api, "machines", left["machines"])
        clear(api, "snapshots", left["snapshots"])
    out = f"--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}"
    print(out)  # shown with pytest -rA: what the reader of the block would see
    assert r.returncode == 0, f"{block.name} exited {r.returncode}\n{out}"
    assert not any(left.values()), f"{block.name} left {left} behind\n{out}"
