"""The guest's network, from ``hangar.net=`` on the kernel command line (stdlib only).

The host (``hangar.net.NetworkManager``) leases each sandbox an address and
QEMU passes ``hangar.net=IP/PREFIX,GATEWAY,DNS`` (DNS may be empty). PID 1
(``hangar.guest.init``) calls ``configure`` before it starts the agent, so
the network is up by the time the host hears the agent's HELLO. Without
that word (policy ``none``) the guest has no NIC and nothing is done.

``configure``:

1. finds the NIC: the first interface other than ``lo`` that has a device
   behind it (``/sys/class/net/*/device``; the virtio-net device, which the
   initramfs' ``virtio_net`` module has registered), waiting at most
   ``WAIT_S`` for it;
2. runs one ``ip -batch`` (iproute2, in every Hangar image): link up,
   flush its addresses, add ``IP/PREFIX``, ``route replace default via
   GATEWAY`` — so running it again (after a restore, say) converges;
3. writes /etc/resolv.conf: ``nameserver DNS``, or only a comment when the
   host gave none.

It never raises (it runs in PID 1, whose death panics the kernel): a
failure is one ``hangar-net: warning: ...`` line on the console, and the
guest goes on without a network. Imports only ``os``, because every import
costs about 25 times its native time under TCG.

Also a command for the agent to re-run: ``python3 -m hangar.guest.net
'hangar.net=...'``.
"""

import os
import sys
import time

from hangar.guest import paths

KEY = "hangar.net"
WAIT_S = 2.0
IP_PATHS = ("/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip",
            paths.RUNTIME_BIN + "/ip")
BATCH_FILE = paths.NET_BATCH
RESOLV_CONF = "/etc/resolv.conf"


def log(msg: str) -> None:
    try:
        os.write(1, f"hangar-net: {msg}\n".encode(errors="replace"))
    except OSError:
        pass


def parse(cmdline: str) -> "tuple[str, int, str, str] | None":
    """(ip, prefix, gateway, dns) from a kernel command line, None without ``hangar.net=``.

    Raises ValueError for a malformed value.
    """
    value = None
    for word in cmdline.split():
        if word.startswith(KEY + "="):
            value = word[len(KEY) + 1:]
    if value is None:
        return None
    parts = value.split(",")
    if len(parts) != 3 or "/" not in parts[0]:
        raise ValueError(f"{KEY}={value!r} is not IP/PREFIX,GATEWAY,DNS")
    ip, _, prefix = parts[0].partition("/")
    for addr in (ip, parts[1]) + ((parts[2],) if parts[2] else ()):
        octets = addr.split(".")
        if len(octets) != 4 or not all(o.isdigit() and int(o) < 256 for o in octets):
            raise ValueError(f"{addr!r} in {KEY}= is not an IPv4 address")
    if not prefix.isdigit() or not 0 < int(prefix) <= 32:
        raise ValueError(f"prefix {prefix!r} in {KEY}= is not 1-32")
    return ip, int(prefix), parts[1], parts[2]


def find_interface(wait_s: float = WAIT_S) -> "str | None":
    """The first non-loopback interface with a device behind it, by ifindex; None after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        try:
            names = os.listdir("/sys/class/net")
        except OSError:
            names = []
        for name in names:
            if name == "lo" or not os.path.exists(f"/sys/class/net/{name}/device"):
                continue
            try:
                with open(f"/sys/class/net/{name}/ifindex") as f:
                    found.append((int(f.read()), name))
            except (OSError, ValueError):
                continue
        if found:
            return min(found)[1]
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.02)


def run_ip_batch(lines: "list[str]") -> None:
    """Run ``ip -batch`` on ``lines``; raises OSError or RuntimeError (with ip's exit status)."""
    exe = next((p for p in IP_PATHS if os.access(p, os.X_OK)), None)
    if exe is None:
        raise RuntimeError("no ip command (install iproute2 in the image)")
    os.makedirs(os.path.dirname(BATCH_FILE), exist_ok=True)
    with open(BATCH_FILE, "w") as f:
        f.write("\n".join(lines) + "\n")
    pid = os.posix_spawn(exe, [exe, "-batch", BATCH_FILE], {"PATH": "/usr/sbin:/usr/bin"},
                         setsigmask=())
    _, status = os.waitpid(pid, 0)
    if status != 0:
        raise RuntimeError(f"ip -batch failed ({os.waitstatus_to_exitcode(status)}): "
                           + "; ".join(lines))


def write_resolv(dns: str) -> None:
    text = "# Hangar: written at boot from hangar.net on the kernel command line.\n"
    text += f"nameserver {dns}\n" if dns else "# The host gave no resolver.\n"
    tmp = RESOLV_CONF + ".hangar-tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, RESOLV_CONF)


def configure(cmdline: str) -> bool:
    """Bring the NIC up as ``hangar.net=`` in ``cmdline`` says; True when it did.

    False (and a console warning) on any failure, and False without a
    ``hangar.net=`` word. Never raises.
    """
    try:
        conf = parse(cmdline)
        if conf is None:
            return False
        ip, prefix, gateway, dns = conf
        ifname = find_interface()
        if ifname is None:
            log("warning: hangar.net= is set but no network interface appeared")
            return False
        run_ip_batch([
            f"link set dev {ifname} up",
            f"addr flush dev {ifname}",
            f"addr add {ip}/{prefix} dev {ifname}",
            f"route replace default via {gateway} dev {ifname}",
        ])
        write_resolv(dns)
        return True
    except Exception as e:  # noqa: BLE001 -- PID 1 must go on
        log(f"warning: cannot configure the network: {e}")
        return False


if __name__ == "__main__":
    sys.exit(0 if configure(" ".join(sys.argv[1:]) or open("/proc/cmdline").read()) else 1)
