"""The host side: the systemd unit, provisioning, log rotation, the readiness checklist.

The unit is checked by ``systemd-analyze verify`` and then run for real: a
private systemd (PID 1 of its own namespaces, every host-facing unit masked,
see ``ops_support.PrivateSystemd``) starts deploy/hangar.service unchanged
but for a drop-in with test paths; a sandbox must survive ``systemctl
restart`` and a crash of the server, and be adopted each time.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import SHARED, SRC, free_port, link_images, server_python, vmm_pids
from ops_support import ROOT, SCRIPTS, PrivateSystemd, fixed_port, hangar_cli

vm = pytest.mark.vm
UNIT = ROOT / "deploy/hangar.service"


# -- the unit ---------------------------------------------------------------------------------


def verify(unit: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                          text=True, timeout=60)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    r = verify(UNIT)
    assert r.returncode == 0 and r.stderr.strip() == "" and r.stdout.strip() == "", r.stderr
    text = UNIT.read_text()
    for line in ("KillMode=process", "Restart=on-failure",
                 "EnvironmentFile=-/etc/hangar/hangar.env",
                 "ExecStart=/usr/local/bin/hangar serve", "WantedBy=multi-user.target"):
        assert re.search(rf"^{re.escape(line)}$", text, re.M), line
    # The check can fail: a misspelt directive and a bad value are reported.
    bad = tmp_path / "hangar.service"
    bad.write_text(text.replace("KillMode=process", "KillMode=proces")
                   .replace("ProtectHome=read-only", "ProtectHme=read-only"))
    r = verify(bad)
    assert "proces" in r.stderr and "ProtectHme" in r.stderr


@pytest.fixture
def systemd_host(base_image: Path) -> Iterator[tuple[PrivateSystemd, Path, int]]:
    why = PrivateSystemd.unavailable()
    if why:
        pytest.skip(why)
    hidden = [str(p) for p in (Path(sys.executable), SRC)
              if p.resolve().parts[:2] == ("/", "tmp")
              or p.resolve().parts[:3] == ("/", "var", "tmp")]
    if hidden:  # the private systemd's /tmp and /var/tmp are its own
        pytest.skip(f"the service would run {hidden[0]}, under a /tmp that the private "
                    "systemd does not see: run the suite from a checkout outside /tmp")
    name = f"hangar-systemd-test-{uuid.uuid4().hex[:8]}"
    top = Path("/var/lib") / name  # outside /tmp, which the private systemd hides
    data = top / "data"
    port = fixed_port()  # the service restarts on it
    env_file = top / "hangar.env"
    top.mkdir(mode=0o711)  # a split server (user hangar) passes through to its data
    data.mkdir(mode=0o700)
    link_images(base_image, data)
    for probe in ("engine-probe.json", "firecracker-probe.json"):
        if (SHARED / probe).exists():
            shutil.copy(SHARED / probe, data / probe)
    env = {"PYTHONPATH": str(SRC)}
    python = server_python(env)
    env_file.write_text(f"HANGAR_DATA_DIR={data}\nHANGAR_PORT={port}\nHANGAR_POOL_SIZE=0\n"
                        f"HANGAR_NETWORK=off\nPYTHONPATH={env['PYTHONPATH']}\n"
                        f"HANGAR_PRIVSEP={env['HANGAR_PRIVSEP']}\n")
    # The image cache may be under /tmp ($HANGAR_DATA_DIR): the private systemd keeps it
    # visible, and the unit binds it onto itself, as its PrivateTmp= hides /tmp too (a
    # ReadWritePaths= there fails the start: 226/NAMESPACE).
    dropin = f"""[Unit]
DefaultDependencies=no
[Service]
EnvironmentFile=
EnvironmentFile={env_file}
ExecStart=
ExecStart={python} -m hangar.cli serve
ReadWritePaths={data}
BindPaths={base_image.parent}
StandardOutput=append:{data}/server.log
StandardError=inherit
"""
    sd = PrivateSystemd(top / "systemd", {"hangar.service": UNIT.read_text(),
                                         "hangar.service.d/test.conf": dropin},
                        keep=base_image.parent)
    try:
        sd.start()
        yield sd, data, port
    finally:
        sd.stop()
        for pid in vmm_pids(str(data)):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(top, ignore_errors=True)


def wait_health(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url}/health did not answer in {timeout} s")


@vm
def test_service_restart_and_crash_keep_sandboxes(systemd_host) -> None:  # type: ignore[no-untyped-def]
    sd, data, port = systemd_host
    url = f"http://127.0.0.1:{port}"
    sd.ctl("start", "hangar.service")
    wait_health(url)
    key = (data / "api-key").read_text().strip()
    with httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=300) as c:
        r = c.post("/sandboxes", json={})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        boot = c.post(f"/sandboxes/{sid}/exec", json={
            "command": "cat /proc/sys/kernel/random/boot_id"}).json()["stdout"]
        vmm = vmm_pids(f"hangar-{sid}")
        assert len(vmm) == 1

        def same_vm() -> None:
            wait_health(url)
            r = c.post(f"/sandboxes/{sid}/exec",
                       json={"command": "cat /proc/sys/kernel/random/boot_id"})
            assert r.status_code == 200, r.text
            assert r.json()["stdout"] == boot
            assert vmm_pids(f"hangar-{sid}") == vmm

        # The image cache's files are hard links shared with every other server on this
        # host: a restart changes no owner (a recursive chown, such as StateDirectory='s,
        # once locked the other split servers out of them).
        owners = {f: (f.stat().st_uid, f.stat().st_gid)
                  for f in (data / "images").glob("*/template-snapshots/*/*") if f.is_file()}
        assert owners
        main = sd.prop("hangar.service", "MainPID")
        sd.ctl("restart", "hangar.service")
        assert sd.prop("hangar.service", "MainPID") != main
        same_vm()
        assert {f: (f.stat().st_uid, f.stat().st_gid) for f in owners} == owners
        # A crash: systemd starts the server again (Restart=on-failure).
        main = sd.prop("hangar.service", "MainPID")
        sd.run("kill", "-9", main)
        deadline = time.monotonic() + 60
        while sd.prop("hangar.service", "NRestarts") != "1":
            assert time.monotonic() < deadline, "systemd did not restart the server"
            time.sleep(0.2)
        same_vm()
        assert (data / "server.log").read_text().count("sandbox adopted") >= 2
        # Stopping the service leaves the VM; the next start adopts it again.
        sd.ctl("stop", "hangar.service")
        assert vmm_pids(f"hangar-{sid}") == vmm
        sd.ctl("start", "hangar.service")
        same_vm()
        assert c.delete(f"/sandboxes/{sid}").status_code == 204
    assert not vmm_pids(str(data))


# -- provisioning -----------------------------------------------------------------------------


def tree_digest(root: Path) -> dict[str, str]:
    """Every path under ``root``: file content hash, link target or dir, with its mode."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        mode = oct(p.lstat().st_mode)
        if p.is_symlink():
            out[rel] = f"link {os.readlink(p)}"
        elif p.is_dir():
            out[rel] = f"dir {mode}"
        else:
            out[rel] = f"{mode} {hashlib.sha256(p.read_bytes()).hexdigest()}"
    return out


def provision(*args: str) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["bash", str(SCRIPTS / "provision-host.sh"), *args], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def test_provision_plans_then_converges(tmp_path: Path) -> None:
    root = tmp_path / "host"
    root.mkdir()
    args = ["--root", str(root), "--domain", "hangar.example.com"]
    plan = provision("--dry-run", *args).stdout
    assert "nothing is changed" in plan and "changes planned" in plan
    for item in ("/etc/modules-load.d/hangar.conf", "/etc/sysctl.d/60-hangar.conf",
                 "nftables.service", "/etc/systemd/system/hangar.service",
                 "/etc/hangar/hangar.env", "/etc/logrotate.d/hangar", "/var/lib/hangar",
                 "/etc/nginx/sites-available/hangar"):
        assert re.search(rf"\[would\] .*{re.escape(item)}", plan), item
    assert list(root.iterdir()) == [], "a dry run wrote files"

    first = provision(*args).stdout
    assert "[changed]" in first
    n = int(re.search(r"(\d+) changes? made", first).group(1))
    assert n == int(re.search(r"(\d+) changes? planned", plan).group(1))
    tree = tree_digest(root)
    second = provision(*args).stdout
    assert "0 changes made" in second and "[changed]" not in second, second
    assert tree_digest(root) == tree

    # What it wrote is what the host needs.
    assert (root / "etc/systemd/system/hangar.service").read_bytes() == UNIT.read_bytes()
    assert os.readlink(root / "etc/systemd/system/multi-user.target.wants/hangar.service") \
        == "/etc/systemd/system/hangar.service"
    assert "net.ipv4.ip_forward = 1" in (root / "etc/sysctl.d/60-hangar.conf").read_text()
    assert (root / "var/lib/hangar").stat().st_mode & 0o777 == 0o700
    assert (root / "etc/hangar/hangar.env").stat().st_mode & 0o777 == 0o600
    site = (root / "etc/nginx/sites-available/hangar").read_text()
    assert "server_name hangar.example.com;" in site
    assert "/etc/letsencrypt/live/hangar.example.com/fullchain.pem" in site
    # Live steps were detected and left alone, each with its reason.
    assert "--root: the running system is left alone" in first

    # The checklist reads the same tree.
    from hangar.ops.checklist import host_checklist

    checks = {c.name: c for c in host_checklist(data_dir=root / "var/lib/hangar", root=root,
                                                server=False)}
    for name in ("modules", "ip_forward", "nftables", "service", "data_dir", "nginx"):
        assert checks[name].ready, checks[name]

    # An operator's edit of the settings survives a run; a tampered unit is put back.
    env = root / "etc/hangar/hangar.env"
    env.write_text(env.read_text() + "HANGAR_MAX_SANDBOXES=7\n")
    (root / "etc/systemd/system/hangar.service").write_text("[Service]\nExecStart=/bin/false\n")
    third = provision(*args).stdout
    assert "1 change made" in third and "HANGAR_MAX_SANDBOXES=7" in env.read_text()
    assert (root / "etc/systemd/system/hangar.service").read_bytes() == UNIT.read_bytes()


def test_provision_sets_up_e2bs_domain(tmp_path: Path) -> None:
    """--e2b-domain: HANGAR_DOMAIN in the settings and nginx's site for *.<domain> with the
    wildcard certificate given; a second run changes nothing."""
    root = tmp_path / "host"
    root.mkdir()
    cert, key = tmp_path / "wild.pem", tmp_path / "wild.key"
    cert.write_text("x")
    key.write_text("x")
    args = ["--root", str(root), "--domain", "hangar.example.com", "--e2b-domain",
            "sbx.example.com", "--e2b-cert", str(cert), "--e2b-key", str(key)]
    first = provision(*args).stdout
    assert "[changed] set HANGAR_DOMAIN=sbx.example.com" in first
    assert "HANGAR_DOMAIN=sbx.example.com\n" in (root / "etc/hangar/hangar.env").read_text()
    site = (root / "etc/nginx/sites-available/hangar").read_text()
    assert "server_name hangar.example.com;" in site and "server_name *.sbx.example.com;" in site
    assert f"ssl_certificate {cert};" in site and f"ssl_certificate_key {key};" in site
    second = provision(*args).stdout
    assert "0 changes made" in second and "[changed]" not in second, second


def test_provision_refuses_bad_input(tmp_path: Path) -> None:
    for args in (["--domain", "bad;name"], ["--email", "a@b.c"], ["--frobnicate"],
                 ["--e2b-domain", "sbx.example.com"],
                 ["--domain", "h.example.com", "--e2b-domain", "bad;name"],
                 ["--domain", "h.example.com", "--e2b-domain", "s.example.com", "--e2b-cert", "/x"],
                 ["--dns-plugin", "cloudflare", "--dns-credentials", "/x"]):
        r = subprocess.run(["bash", str(SCRIPTS / "provision-host.sh"), "--root", str(tmp_path),
                            *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and r.stderr, args
    assert list(tmp_path.iterdir()) == []


# -- log rotation and the checklist -------------------------------------------------------------


@pytest.mark.skipif(shutil.which("logrotate") is None, reason="needs logrotate")
def test_file_log_rotates_while_the_server_writes(tmp_path: Path) -> None:
    log = tmp_path / "hangar.log"
    conf = tmp_path / "logrotate.conf"
    conf.write_text((ROOT / "deploy/logrotate/hangar").read_text()
                    .replace("/var/log/hangar/hangar.log", str(log)))
    # A writer like `nohup hangar serve >>hangar.log`: one O_APPEND descriptor, kept open.
    writer = subprocess.Popen(["sh", "-c", "i=0; while true; do i=$((i+1)); echo line $i; "
                                           "sleep 0.05; done"],
                              stdout=open(log, "ab"), start_new_session=True)
    try:
        while log.stat().st_size < 200:
            time.sleep(0.05)
        r = subprocess.run(["logrotate", "-f", "-s", str(tmp_path / "state"), str(conf)],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        rotated = tmp_path / "hangar.log.1"
        assert rotated.exists() and "line 1\n" in rotated.read_text()
        size = log.stat().st_size
        assert size < rotated.stat().st_size
        time.sleep(0.5)
        text = log.read_text()
        assert log.stat().st_size > size and "\0" not in text, "the writer lost its place"
    finally:
        os.killpg(writer.pid, signal.SIGKILL)
        writer.wait()


def test_doctor_prints_the_checklist(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    r = hangar_cli("doctor", "--data-dir", str(data), env={"HANGAR_PORT": str(free_port())})
    out = r.stdout
    assert "qemu accelerator" in out and "engine 'auto' picks" in out  # today's lines stay
    assert re.search(r"host readiness \(\d+/\d+ ready\):", out)
    assert "[!!] data_dir" in out and f"chmod 0700 {data}" in out
    assert "[!!] image: the base image is not built" in out
    assert "[!!] server:" in out and "fix: start Hangar" in out
