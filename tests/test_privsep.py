"""Class 9: the process that parses HTTP runs unprivileged (``HANGAR_PRIVSEP=1``).

A real split server: its HTTP process runs as ``hangar`` (uid != 0, no
capabilities, ``NoNewPrivs``), its privileged helper (its child) as root;
a confined sandbox is created, runs a command, is snapshotted and deleted,
all through the helper. The helper's request table refuses what it does
not know, extra fields, wrong types and requests that do not check out
against the host.
"""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import Server, cleanup, free_port, make_data_dir, vmm_pids
from hangar.engines.confine import ConfineConfig, Confinement
from hangar.layout import Layout

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the split starts as root")


def status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def children(pid: int) -> list[int]:
    raw = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(x) for x in raw]


@pytest.fixture(scope="module")
def srv(base_image) -> Iterator[Server]:  # noqa: ANN001
    try:
        import pwd
        pwd.getpwnam("hangar")
    except KeyError:
        pytest.fail("no hangar user: scripts/install.sh makes it")
    d = make_data_dir(base_image, privsep=True)
    s = Server(d, free_port(), {"HANGAR_PRIVSEP": "1"})
    try:
        s.start(timeout=120)
        yield s
    finally:
        leaked = cleanup(s)
        shutil.rmtree(d, ignore_errors=True)
        assert not leaked, f"VMM processes outlived the module: {leaked}"


def test_http_server_is_unprivileged(srv: Server) -> None:
    assert srv.proc is not None
    st = status(srv.proc.pid)
    uids = st["Uid"].split()
    assert "0" not in uids and "0" not in st["Gid"].split(), st["Uid"]
    for caps in ("CapEff", "CapPrm", "CapInh", "CapAmb"):  # none, and no way back
        assert int(st[caps], 16) == 0, (caps, st[caps])
    assert st["NoNewPrivs"] == "1"
    # The listening socket is the unprivileged process's own.
    port_hex = f"{srv.port:04X}"
    inodes = {line.split()[9] for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
              if line.split()[1].endswith(":" + port_hex) and line.split()[3] == "0A"}
    fds = {os.readlink(f"/proc/{srv.proc.pid}/fd/{fd}")
           for fd in os.listdir(f"/proc/{srv.proc.pid}/fd")}
    assert any(f"socket:[{i}]" in fds for i in inodes)
    helpers = children(srv.proc.pid)
    assert any(status(p)["Uid"].split()[0] == "0" for p in helpers), helpers
    assert (srv.data_dir / "api-key").stat().st_uid == int(uids[0])


def test_confined_sandbox_through_the_helper(srv: Server) -> None:
    with srv.client() as api:
        r = api.post("/sandboxes", json={})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        pid = vmm_pids(f"hangar-{sid}")[0]
        st = status(pid)
        assert st["Uid"].split()[0] not in ("0", status(srv.proc.pid)["Uid"].split()[0])
        assert st["NSpid"].split()[-1] == "1"
        r = api.post(f"/sandboxes/{sid}/exec", json={"command": "echo split"})
        assert r.status_code == 200, r.text
        assert r.json()["stdout"] == "split\n"
        got = api.get(f"/sandboxes/{sid}").json()
        assert (got.get("memory") or {}).get("host_mib", 0) > 0, got
        snap = api.post(f"/sandboxes/{sid}/snapshot")
        assert snap.status_code == 201, snap.text
        assert api.delete(f"/snapshots/{snap.json()['id']}").status_code == 204
        assert api.delete(f"/sandboxes/{sid}").status_code == 204
        assert not vmm_pids(f"hangar-{sid}")
        assert not (srv.data_dir / "sandboxes" / sid).exists()


def test_template_snapshots_are_restored_read_only_and_root_written_keys_are_the_servers(
        srv: Server) -> None:
    """The image cache's template snapshots (made by root) are handed over read-only:
    root's files, group-readable by the server's group, writable by nobody else; the split
    server's creates restore them instead of booting to make its own. A key that root adds
    with the CLI to the split server's data directory is the server's, and it accepts it."""
    import grp
    import pwd
    import subprocess
    import sys

    from conftest import SRC

    gid = grp.getgrnam("hangar").gr_gid
    shared = [f for f in (srv.data_dir / "images").glob("*/template-snapshots/*/*")
              if f.stat().st_uid == 0]
    assert shared, "no template snapshot of root's in the image copy"
    for f in shared:
        st = f.stat()
        assert st.st_gid == gid and st.st_mode & 0o040 and not st.st_mode & 0o022, (f, st)
    with srv.client() as api:
        r = api.post("/sandboxes", json={})
        assert r.status_code == 201, r.text
        assert r.json()["source"] == "template"
        assert api.delete(f"/sandboxes/{r.json()['id']}").status_code == 204
    assert "template snapshot made" not in srv.log.read_text()
    out = subprocess.run([sys.executable, "-m", "hangar.cli", "key", "add", "split-added"],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(SRC),
                              "HANGAR_DATA_DIR": str(srv.data_dir)})
    assert out.returncode == 0, out.stderr
    keys = srv.data_dir / "api-keys"
    assert keys.stat().st_uid == pwd.getpwnam("hangar").pw_uid
    import httpx

    r = httpx.get(srv.url + "/sandboxes", headers={"X-API-Key": out.stdout.strip()})
    assert r.status_code == 200, r.text


def test_the_helper_refuses_what_the_table_does_not_hold(tmp_path: Path) -> None:
    from hangar.roothelper import Helper

    layout = Layout(tmp_path)
    layout.ensure()
    h = Helper(layout, Confinement(ConfineConfig(uid_registry=tmp_path / "uids")), 999,
               "/usr/bin/qemu-system-x86_64")
    bad = [
        b'{"op": "exec", "argv": ["sh"]}',
        b'{"op": "ping", "extra": 1}',
        b'{"op": "kill_vmm", "pid": "1234"}',
        b'{"op": "kill_vmm", "pid": 1}',
        b'{"op": "release_vmm", "sandbox_id": "../../etc"}',
        b'not json',
    ]
    for raw in bad:
        answer = h.answer(raw, [])
        assert answer["ok"] is False and answer["error"].startswith("bad request"), (raw, answer)
    assert h.answer(b'{"op": "ping"}', []) == {"ok": True, "result": "pong"}
    # Valid in form, refused against the host: pid 1 runs as root, not as a VMM uid.
    assert "is not a VMM" in h.answer(b'{"op": "kill_vmm", "pid": %d}' % os.getpid(), [])["error"]
    assert "is not a VMM" in h.answer(b'{"op": "vmm_memory", "pid": %d}' % os.getpid(),
                                      [])["error"]
    spawn = (b'{"op": "spawn_vmm", "sandbox_id": "sb-x", "argv": ["/bin/sh", "-c", "id"]}')
    assert "only /usr/bin/qemu-system-x86_64" in h.answer(spawn, [])["error"]
    no_seccomp = (b'{"op": "spawn_vmm", "sandbox_id": "sb-x", "argv": '
                  b'["/usr/bin/qemu-system-x86_64", "-sandbox", "off"]}')
    assert "runs with -sandbox on," in h.answer(no_seccomp, [])["error"]
    prep = (b'{"op": "prepare_vmm", "sandbox_id": "sb-none", "vcpus": 1, "memory_mib": 256,'
            b' "accel": "tcg", "tcg_cache_mib": 64, "reads": ["/etc"], "owned": []}')
    assert "no sandbox folder" in h.answer(prep, [])["error"]
    (layout.sandboxes / "sb-x").mkdir()
    prep = prep.replace(b"sb-none", b"sb-x")
    assert "not an image folder" in h.answer(prep, [])["error"]
    # Descriptors sent with a refused request are closed, not kept.
    r, w = os.pipe()
    h.answer(b'{"op": "nope"}', [r])
    with pytest.raises(OSError):
        os.fstat(r)
    os.close(w)
    socket.socketpair()  # (the real channel is a SOCK_SEQPACKET socketpair)


def test_split_refuses_what_would_fail_later(base_image) -> None:  # noqa: ANN001
    """No such user, or a Python the user cannot read: `hangar serve` exits at once with
    the reason, before it listens."""
    import subprocess
    import sys
    import sysconfig

    from conftest import SRC
    from hangar.privileged.split import unreadable

    d = make_data_dir(base_image, privsep=True)
    try:
        def serve(python: str, path: str, **env: str | None) -> subprocess.CompletedProcess[str]:
            full = {**os.environ, "PYTHONPATH": path, "HANGAR_DATA_DIR": str(d),
                    "HANGAR_PRIVSEP": "1", "HANGAR_NETWORK": "off", **env}
            return subprocess.run(
                [python, "-m", "hangar.cli", "serve", "--port", str(free_port())],
                capture_output=True, text=True, timeout=120,
                env={k: v for k, v in full.items() if v is not None})

        out = serve(sys.executable, str(SRC), HANGAR_USER="no-such-user-here")
        assert out.returncode == 1 and "no user 'no-such-user-here'" in out.stderr, out.stderr
        # The default (HANGAR_PRIVSEP unset) splits too: never root silently, and the one
        # line names the fixes.
        out = serve(sys.executable, str(SRC), HANGAR_USER="no-such-user-here",
                    HANGAR_PRIVSEP=None)
        assert out.returncode == 1, out.stderr
        said = " ".join(out.stderr.split())  # one message (the console wraps it)
        assert "no user 'no-such-user-here'" in said, said
        assert "scripts/install.sh" in said and "HANGAR_PRIVSEP=0" in said, said
        import pwd
        pw = pwd.getpwnam("hangar")
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        if unreadable([stdlib], pw.pw_uid, pw.pw_gid):  # this host's Python (under /root)
            out = serve(sys.executable, str(SRC))
            assert out.returncode == 1, out.stderr
            assert f"cannot read {stdlib}" in out.stderr, out.stderr
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_a_second_server_on_the_same_data_directory_is_refused(srv: Server) -> None:
    """Two servers on one data directory would each sweep the other's VMMs and folders as
    orphans: the second one exits naming the first."""
    import subprocess
    import sys

    from conftest import SRC

    out = subprocess.run(
        [sys.executable, "-m", "hangar.cli", "serve", "--port", str(free_port())],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(SRC), "HANGAR_DATA_DIR": str(srv.data_dir),
             "HANGAR_POOL_SIZE": "0", "HANGAR_NETWORK": "off"})
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "another Hangar server" in text and str(srv.data_dir) in text, text[-2000:]
    with srv.client() as c:
        assert c.get("/health").status_code == 200  # the first one is untouched


def test_split_needs_the_kernels_hard_link_protection(tmp_path: Path) -> None:
    """Root re-owns files in the server's folders (template snapshots): with
    ``fs.protected_hardlinks`` 0 the server could link a file of root's there, so the split
    refuses to start, naming the sysctl; ``hangar doctor``'s checklist says how to set it."""
    from hangar.errors import ConfigError
    from hangar.ops import checklist
    from hangar.roothelper import check_links

    sysctl = tmp_path / "protected_hardlinks"
    sysctl.write_text("0\n")
    with pytest.raises(ConfigError, match="fs.protected_hardlinks is 0"):
        check_links(str(sysctl))
    c = checklist.check_hardlinks(sysctl)
    assert (c.status, c.fix) == (checklist.NOT_READY, (
        "scripts/provision-host.sh, or sysctl -w fs.protected_hardlinks=1 and the same in "
        "/etc/sysctl.d/60-hangar.conf"))
    sysctl.write_text("1\n")
    check_links(str(sysctl))
    assert checklist.check_hardlinks(sysctl).status == checklist.OK
