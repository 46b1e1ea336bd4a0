"""E2B programs configured with ``E2B_DOMAIN`` and ``E2B_API_KEY`` alone, over real TLS.

E2B's SDKs, without ``E2B_API_URL`` and ``E2B_SANDBOX_URL`` (deprecated in SDK 2.63),
call ``https://api.<domain>`` and ``https://<port>-<id>.<domain>`` on port 443. This
module runs them against a server of its own with ``HANGAR_DOMAIN=<domain>`` (a name
unique to the run, under ``.test``) behind tests/e2b_site.py's site, what a user's host
has (docs/e2b.md, "E2B_DOMAIN: one host"): a local CA and a wildcard certificate, a
wildcard DNS server and nginx on a loopback address of the run's own, each program in a
mount namespace whose ``/etc/resolv.conf`` names that server, with ``SSL_CERT_FILE`` and
``NODE_EXTRA_CA_CERTS`` naming the CA: nothing of the host's changes.

The programs: the newest Python SDK (this venv's ``e2b``) and the npm ``e2b`` SDK
(installed here with npm at ``E2B_JS_VERSION``; skipped when npm cannot reach its
registry). Both create, run commands (with callbacks, in the background), write, read
and list files (Python: also through a signed download URL), watch a folder, pause and
connect, fetch a user port through ``get_host`` over https and kill; E2B's code
interpreter SDKs (PyPI's ``e2b_code_interpreter`` and npm's ``@e2b/code-interpreter`` at
``E2B_JS_CODE_INTERPRETER_VERSION``) run code in a context and draw a chart (port 49999).
Everything made is removed, pass or fail.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import Server, own_server
from ops_support import hangar_cli

pytest.importorskip("dns.message")
pytest.importorskip("cryptography.x509")
from e2b_site import NoLoopbackAddress, SiteFiles, site as e2b_site  # noqa: E402

vm = pytest.mark.vm
E2B_JS_VERSION = "2.51.0"
"""The npm ``e2b`` SDK the JS program runs with (the newest when this was written)."""
E2B_JS_CODE_INTERPRETER_VERSION = "2.8.0"
"""The npm ``@e2b/code-interpreter`` SDK (the newest when this was written; it takes
``e2b`` ^2.48.0, so the pair installed is this and ``E2B_JS_VERSION``)."""
PROGRAM_TIMEOUT_S = 900



def test_e2bs_host_names_become_hangars_paths() -> None:
    """api.<domain> is /e2b; 49983-<id>.<domain> is /e2b/envd for that sandbox (the host's
    id wins over a header's); other ports, other names and no domain pass untouched."""
    from hangar.api.e2b_hosts import rewrite
    from hangar.api.proxy.routing import route

    def scope(host: str, path: str = "/v2/sandboxes",
              headers: tuple[tuple[bytes, bytes], ...] = ()) -> dict[str, Any]:
        return {"type": "http", "path": path, "raw_path": path.encode(),
                "headers": [(b"host", host.encode()), *headers]}

    api = rewrite(scope("API.sbx.test:443"), "sbx.test")
    assert api is not None and (api["path"], api["raw_path"]) == ("/e2b/v2/sandboxes",
                                                                  b"/e2b/v2/sandboxes")
    envd = rewrite(scope("49983-sb-0123456789ab.sbx.test", "/files",
                         headers=((b"e2b-sandbox-id", b"sb-other"),)), "sbx.test")
    assert envd is not None and envd["path"] == "/e2b/envd/files"
    assert [h for h in envd["headers"] if h[0] != b"host"] == [
        (b"e2b-sandbox-id", b"sb-0123456789ab"), (b"e2b-sandbox-port", b"49983")]
    assert route(envd, "sbx.test") is None  # envd is Hangar's, not a guest port
    for host in ("3000-sb-1.sbx.test", "api.sbx.test.evil", "x.api.sbx.test",
                 "49983-sb-1.x.sbx.test", "sbx.test", "api.other.test"):
        assert rewrite(scope(host), "sbx.test") is None, host
    assert rewrite(scope("api.sbx.test"), None) is None
    assert route(scope("3000-sb-1.sbx.test", "/"), "sbx.test") is not None


def needs_root_nginx() -> None:
    if os.geteuid() != 0:
        pytest.skip("binds ports 443 and 53 on a loopback address and unshares mounts: root")
    if shutil.which("nginx") is None or shutil.which("unshare") is None:
        pytest.skip("needs Debian's nginx and unshare")


# -- the whole setup --------------------------------------------------------------------------

@dataclass
class Site:
    server: Server
    files: SiteFiles
    key: str

    @property
    def domain(self) -> str:
        return self.files.domain

    @property
    def address(self) -> str:
        return self.files.address

    def run(self, argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
        """``argv`` in a mount namespace whose /etc/resolv.conf names the site's DNS, with
        ``E2B_DOMAIN``, ``E2B_API_KEY`` and the CA (no other E2B variable, no proxy)."""
        return subprocess.run(self.files.wrap(argv), env=self.files.env(os.environ, self.key),
                              cwd=cwd, capture_output=True, text=True,
                              timeout=PROGRAM_TIMEOUT_S)

    def program(self, argv: list[str], cwd: Path) -> Any:
        """The JSON a program ``run`` prints last; it must exit 0."""
        r = self.run(argv, cwd)
        assert r.returncode == 0, r.stderr[-4000:]
        return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def site(base_image: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    """A server with ``HANGAR_DOMAIN``, its E2B key, and tests/e2b_site.py's site before it."""
    needs_root_nginx()
    domain = f"hangar-{uuid.uuid4().hex[:8]}.test"
    with own_server(base_image, {"HANGAR_DOMAIN": domain}) as server:
        r = hangar_cli("key", "add", f"e2b-{uuid.uuid4().hex[:8]}", "--e2b",
                       env={"HANGAR_DATA_DIR": str(server.data_dir)})
        api_key = r.stdout.strip().splitlines()[-1]
        try:
            with e2b_site(tmp_path_factory.mktemp("e2b-domain"), domain,
                          f"127.0.0.1:{server.port}") as files:
                yield Site(server, files, api_key)
        except NoLoopbackAddress as e:
            pytest.skip(str(e))


def test_the_site_names_e2bs_hosts_with_the_wildcard_certificate(site: Site,
                                                                  tmp_path: Path) -> None:
    """Through the namespace's resolver, api.<domain> and a sandbox's envd host answer over
    TLS verified by the CA: the control plane's health (E2B's 204, not Hangar's own 200), its
    list with the key, and envd's 401 without a token."""
    probe = tmp_path / "probe.py"
    probe.write_text(textwrap.dedent("""
        import json, os, socket, httpx
        d = os.environ["E2B_DOMAIN"]
        out = {"addr": socket.gethostbyname("api." + d)}
        with httpx.Client() as c:
            out["health"] = c.get(f"https://api.{d}/health").status_code
            out["list"] = c.get(f"https://api.{d}/v2/sandboxes",
                                headers={"X-API-KEY": os.environ["E2B_API_KEY"]}).status_code
            r = c.get(f"https://49983-sb-000000000000.{d}/health")
            out["envd"] = [r.status_code, r.headers.get("content-type")]
        print(json.dumps(out))
    """))
    out = site.program([sys.executable, str(probe)], tmp_path)
    assert out == {"addr": site.address, "health": 204, "list": 200,
                   "envd": [401, "application/json"]}


PY_PROGRAM = """
import json, time, httpx
from e2b import Sandbox, TimeoutException

log = {}
sbx = Sandbox.create("base", timeout=600)
try:
    log["domain"] = sbx.sandbox_domain
    seen = []
    r = sbx.commands.run("echo one; echo two", on_stdout=seen.append)
    log["run"] = [r.exit_code, r.stdout, "".join(seen)]
    bg = sbx.commands.run("sleep 1; echo late", background=True)
    log["background"] = bg.wait().stdout
    sbx.files.make_dir("watched")
    w = sbx.files.watch_dir("watched")
    sbx.files.write("watched/a.txt", "hello over TLS")
    names = set()
    for _ in range(60):
        names |= {e.name for e in w.get_new_events()}
        if "a.txt" in names:
            break
        time.sleep(0.5)
    w.stop()
    log["watch"] = sorted(names)
    log["read"] = sbx.files.read("watched/a.txt")
    log["list"] = [e.name for e in sbx.files.list("watched")]
    log["signed"] = httpx.get(sbx.download_url("watched/a.txt"), timeout=30).text
    sbx.files.write("/tmp/web/index.html", "served")
    sbx.commands.run("python3 -m http.server 8000", cwd="/tmp/web", background=True,
                     timeout=0)
    host = sbx.get_host(8000)
    log["host"] = host
    body = None
    for _ in range(120):
        try:
            r = httpx.get(f"https://{host}/index.html", timeout=10)
            if r.status_code == 200:
                body = r.text
                break
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    log["port"] = body
    log["pause"] = sbx.pause()
    log["paused_running"] = sbx.is_running()
    again = Sandbox.connect(sbx.sandbox_id)
    log["after_connect"] = again.commands.run("cat watched/a.txt").stdout
    running = again.commands.run("sleep 60", background=True)
finally:
    log["kill"] = sbx.kill()
try:  # the sandbox killed under a running command: the SDK's stream is reset, and its
    running.wait()  # health probe (a 502) confirms the sandbox gone
    log["killed_wait"] = "returned"
except TimeoutException as exc:
    log["killed_wait"] = str(exc)
print(json.dumps(log))
"""


@vm
def test_the_newest_python_sdk_runs_a_program_with_e2b_domain_alone(site: Site,
                                                                     tmp_path: Path) -> None:
    prog = tmp_path / "program.py"
    prog.write_text(PY_PROGRAM)
    log = site.program([sys.executable, str(prog)], tmp_path)
    assert log["domain"] == site.domain
    assert log["signed"] == "hello over TLS"  # a signed download URL, at 49983-<id>.<domain>
    # over HTTP/2 (the site's TLS offers it, as E2B's edge does) a cut stream is a reset
    # stream, which the SDK confirms gone by its health probe; HTTP/1.1 through nginx
    # ended it with a plain close, and the SDK raised a protocol error instead
    assert "sandbox was killed or reached its end of life" in log["killed_wait"]
    assert_typical_calls(log, site, paused_running="paused_running",
                         after_connect="after_connect")


def assert_typical_calls(log: dict[str, Any], site: Site, *, paused_running: str,
                         after_connect: str) -> None:
    """What both SDKs' programs report of the typical calls (their own key names for the
    two that differ by language)."""
    assert log["run"] == [0, "one\ntwo\n", "one\ntwo\n"]
    assert log["background"] == "late\n"
    assert "a.txt" in log["watch"]
    assert log["read"] == "hello over TLS"
    assert log["list"] == ["a.txt"]
    assert log["host"].startswith("8000-") and log["host"].endswith("." + site.domain)
    assert log["port"] == "served"
    assert log["pause"] is True and log[paused_running] is False
    assert log[after_connect] == "hello over TLS"
    assert log["kill"] is True


JS_PROGRAM = """
const { Sandbox } = require('e2b')

async function main() {
  const log = {}
  const sbx = await Sandbox.create('base', { timeoutMs: 600_000 })
  try {
    const seen = []
    const r = await sbx.commands.run('echo one; echo two', { onStdout: (s) => { seen.push(s) } })
    log.run = [r.exitCode, r.stdout, seen.join('')]
    const bg = await sbx.commands.run('sleep 1; echo late', { background: true })
    log.background = (await bg.wait()).stdout
    await sbx.files.makeDir('watched')
    const names = new Set()
    const w = await sbx.files.watchDir('watched', (e) => { names.add(e.name) })
    await sbx.files.write('watched/a.txt', 'hello over TLS')
    for (let i = 0; i < 60 && !names.has('a.txt'); i++) await new Promise((ok) => setTimeout(ok, 500))
    await w.stop()
    log.watch = [...names].sort()
    log.read = await sbx.files.read('watched/a.txt')
    log.list = (await sbx.files.list('watched')).map((e) => e.name)
    await sbx.files.write('/tmp/web/index.html', 'served')
    await sbx.commands.run('python3 -m http.server 8000',
                           { cwd: '/tmp/web', background: true, timeoutMs: 0 })
    const host = sbx.getHost(8000)
    log.host = host
    log.port = null
    for (let i = 0; i < 120 && log.port === null; i++) {
      try {
        const res = await fetch(`https://${host}/index.html`)
        if (res.status === 200) log.port = await res.text()
      } catch (e) { }
      if (log.port === null) await new Promise((ok) => setTimeout(ok, 500))
    }
    log.pause = await sbx.pause()
    log.pausedRunning = await sbx.isRunning()
    const again = await Sandbox.connect(sbx.sandboxId)
    log.afterConnect = (await again.commands.run('cat watched/a.txt')).stdout
  } finally {
    log.kill = await sbx.kill()
  }
  console.log(JSON.stringify(log))
}

main().catch((e) => { console.error(e); process.exit(1) })
"""


@pytest.fixture(scope="module")
def js_sdk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A folder with the npm ``e2b`` SDK at ``E2B_JS_VERSION`` and
    ``@e2b/code-interpreter`` at ``E2B_JS_CODE_INTERPRETER_VERSION`` installed (npm's own
    registry setting); skips when npm or its registry is not reachable."""
    if shutil.which("npm") is None or shutil.which("node") is None:
        pytest.skip("needs node and npm")
    folder = tmp_path_factory.mktemp("e2b-js")
    (folder / "package.json").write_text('{"name": "e2b-domain-test", "private": true}\n')
    try:
        r = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--save-exact",
                            f"e2b@{E2B_JS_VERSION}",
                            f"@e2b/code-interpreter@{E2B_JS_CODE_INTERPRETER_VERSION}"],
                           cwd=folder, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        shutil.rmtree(folder, ignore_errors=True)
        pytest.skip("npm install timed out: its registry is not reachable")
    if r.returncode != 0:
        shutil.rmtree(folder, ignore_errors=True)
        pytest.skip(f"npm cannot install e2b@{E2B_JS_VERSION} and @e2b/code-interpreter@"
                    f"{E2B_JS_CODE_INTERPRETER_VERSION}: {r.stderr.strip()[-500:]}")
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@vm
def test_the_npm_sdk_runs_a_program_with_e2b_domain_alone(site: Site, js_sdk: Path) -> None:
    prog = js_sdk / "program.js"
    prog.write_text(JS_PROGRAM)
    log = site.program(["node", str(prog)], js_sdk)
    assert_typical_calls(log, site, paused_running="pausedRunning",
                         after_connect="afterConnect")


CI_PROGRAM = """
import json
from e2b_code_interpreter import Sandbox

log = {}
sbx = Sandbox.create(timeout=600)
try:
    ctx = sbx.create_code_context()
    log["context"] = sbx.run_code("x = 40 + 2; x", context=ctx).text
    chart = sbx.run_code("import matplotlib.pyplot as plt\\n"
                         "plt.plot([1, 2, 3], [2, 4, 1]); plt.title('over TLS'); plt.show()")
    log["chart"] = [bool(r.png) for r in chart.results]
    log["error"] = chart.error is None
finally:
    log["kill"] = sbx.kill()
print(json.dumps(log))
"""


@vm
def test_the_code_interpreter_runs_a_chart_with_e2b_domain_alone(site: Site,
                                                                 tmp_path: Path) -> None:
    """E2B's code interpreter SDK reaches port 49999 at ``49999-<id>.<domain>``."""
    pytest.importorskip("e2b_code_interpreter")
    if not (Path(site.server.data_dir) / "images" / "code-interpreter").exists():
        pytest.skip("the code-interpreter image is not built")
    prog = tmp_path / "ci.py"
    prog.write_text(CI_PROGRAM)
    assert site.program([sys.executable, str(prog)], tmp_path) == {
        "context": "42", "chart": [True], "error": True, "kill": True}


JS_CI_PROGRAM = """
const { Sandbox } = require('@e2b/code-interpreter')

async function main() {
  const log = {}
  const sbx = await Sandbox.create({ timeoutMs: 600_000 })
  try {
    const ctx = await sbx.createCodeContext()
    log.context = (await sbx.runCode('x = 40 + 2; x', { context: ctx })).text
    const chart = await sbx.runCode("import matplotlib.pyplot as plt\\n" +
      "plt.plot([1, 2, 3], [2, 4, 1]); plt.title('over TLS'); plt.show()")
    log.chart = chart.results.map((r) => Boolean(r.png))
    log.error = chart.error === undefined || chart.error === null
  } finally {
    log.kill = await sbx.kill()
  }
  console.log(JSON.stringify(log))
}

main().catch((e) => { console.error(e); process.exit(1) })
"""


@vm
def test_the_npm_code_interpreter_runs_a_chart_with_e2b_domain_alone(site: Site,
                                                                     js_sdk: Path) -> None:
    """The npm ``@e2b/code-interpreter`` SDK reaches port 49999 at ``49999-<id>.<domain>``."""
    if not (Path(site.server.data_dir) / "images" / "code-interpreter").exists():
        pytest.skip("the code-interpreter image is not built")
    prog = js_sdk / "ci.js"
    prog.write_text(JS_CI_PROGRAM)
    assert site.program(["node", str(prog)], js_sdk) == {
        "context": "42", "chart": [True], "error": True, "kill": True}
