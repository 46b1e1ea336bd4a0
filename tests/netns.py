"""Network namespaces for the tests that build a stand-in internet beside Hangar's side
(test_network.py, test_secrets.py, egress_lab.py): the checks, the commands and the
teardown they share. Each module names namespaces of its own."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterable


def can_netns() -> str | None:
    """Why namespaces, TAPs and nftables cannot be used here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, TAPs, nftables)"
    for tool in ("ip", "nft", "nsenter"):
        if shutil.which(tool) is None:
            return f"needs the {tool} command"
    if not os.path.exists("/dev/net/tun"):
        return "needs /dev/net/tun"
    return None


def run(cmd: str) -> str:
    """A shell command's output; raises CalledProcessError when it fails."""
    return subprocess.run(cmd, shell=True, check=True, capture_output=True, text=True).stdout


def kill_groups(procs: Iterable[subprocess.Popen[bytes]]) -> None:
    """SIGKILL each process's group (they start new sessions) and reap it."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def delete_namespaces(*names: str) -> None:
    """Delete ``names`` (every device and rule made inside goes with them); a missing
    one is no error."""
    for ns in names:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def remove_namespaces(*names: str) -> None:
    """``delete_namespaces``, then assert none of ``names`` is left."""
    delete_namespaces(*names)
    left = run("ip netns list")
    assert not any(ns in left for ns in names), left
