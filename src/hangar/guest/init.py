"""PID 1 of a Hangar guest (standard library only).

The initramfs ``switch_root``s to ``python3 -S``, which imports this module
(precompiled) and calls ``main()``; it can also run as a script. This process
then, in order and without starting any other program until the agent runs:

1. checks the mounts and mounts what is missing: /proc, /sys, /dev
   (devtmpfs), /dev/pts, /dev/shm, /run, /tmp (tmpfs) and /sys/fs/cgroup
   (cgroup2), and adds the /dev/fd, /dev/stdin... links a udev would make.
   Hangar's initramfs has mounted all of these already (busybox is quicker
   than importing ctypes under TCG), so normally this only checks;
2. sets the hostname from ``hangar.hostname=`` on the kernel command line
   (default ``hangar``), writes a fresh ``/etc/machine-id`` and fork
   generation 0 (``hangar.guest.identity``), makes sure ``lo`` is up, and
   with ``hangar.net=`` brings the NIC up (``hangar.guest.net.configure``);
3. starts the agent, ``hangar.guest.agent``, in a child forked from this
   process (``fork_agent``: the interpreter is already running, which saves
   starting another, about 0.1 s under TCG, and this process never imports
   the agent itself; it is ``/usr/bin/python3``, or Hangar's own runtime in
   images imported from OCI), with ``PYTHONPATH=/usr/lib/hangar/python`` in
   its environment, in its own session, stdin /dev/null, stdout and stderr
   on /dev/console (the serial console), and prints ``hangar-init: agent
   started``; the uptimes at which this init began and started the agent go
   to /run/hangar/boot after the initramfs' own (``BOOT_MARKS``), which the
   agent reports in its HELLO;
4. grows the root file system online to fill the (qcow2) disk (``grow_root``:
   the ioctl ``resize2fs`` would make) and, with ``hangar.desktop=``, starts
   the desktop supervisor (``hangar.guest.desktop.start``);
5. loops: reaps every child (the agent and the orphans the
   kernel reparents to PID 1; the agent reaps its own children), restarts
   the agent with a backoff of 0.25 s doubling to 5 s when it exits (reset
   after 10 s of running), and powers off on SIGTERM, SIGINT or SIGPWR (the
   rootfs' ``poweroff``/``halt``/``reboot``/``shutdown`` send SIGTERM to PID
   1), or ``hangar.poweroff_after=<seconds>`` after start (for tests).

Power-off: SIGTERM to every process, up to 2 s for them to exit, SIGKILL,
``sync``, remount / read-only, then ``reboot(2)`` with ``RB_POWER_OFF``.

Signals are blocked and taken with ``sigtimedwait`` (the kernel drops
signals to PID 1 that it neither blocks nor handles); the agent starts with
an empty mask and Python's own dispositions. Startup cost matters: under TCG every
import costs about 25 times its native time, so this module uses ``_signal``
and ``_socket`` rather than ``signal`` (which imports enum) and ``socket``,
and imports ctypes only to mount something the initramfs did not, and to
power off.
"""

import errno
import os
import sys
import time

from hangar.guest import identity, paths
from hangar.guest.identity import valid_hostname

try:
    import _signal as signal  # the C module under ``signal``, without its enum import
except ImportError:  # pragma: no cover
    import signal  # type: ignore[no-redef]

CONSOLE = "/dev/console"
PYTHON_DIR = paths.PYTHON_DIR
AGENT_MODULE = "hangar.guest.agent"
"""The agent, run in a child forked from this process (``fork_agent``)."""
BOOT_MARKS = paths.BOOT_MARKS
"""Uptimes at the boot's steps, one ``<step> <uptime s>`` a line; the initramfs began it."""
ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": paths.HOME,
    "LANG": "C.UTF-8",
    "TERM": "xterm-256color",
}
RB_POWER_OFF = 0x4321FEDC
EXT4_IOC_RESIZE_FS = 0x40086610  # _IOW('f', 16, __u64), linux/ext4.h
BACKOFF_FIRST_S = 0.25
BACKOFF_MAX_S = 5.0
BACKOFF_RESET_S = 10.0
SHUTDOWN_GRACE_S = 2.0

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_RELATIME = 1 << 21

MOUNTS = (
    # source, target, fstype, flags, data, required
    ("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "", True),
    ("sysfs", "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "", True),
    ("devtmpfs", "/dev", "devtmpfs", MS_NOSUID, "mode=0755", True),
    ("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "gid=5,mode=0620,ptmxmode=0666", True),
    ("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777", True),
    ("tmpfs", "/run", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755", True),
    ("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777", True),
    ("cgroup2", "/sys/fs/cgroup", "cgroup2", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RELATIME,
     "favordynmods", False),  # cheap moves between cgroups (hangar.guest.limits)
)
DEV_LINKS = {"/dev/fd": "/proc/self/fd", "/dev/stdin": "/proc/self/fd/0",
             "/dev/stdout": "/proc/self/fd/1", "/dev/stderr": "/proc/self/fd/2",
             "/dev/core": "/proc/kcore"}

WATCHED = {signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGPWR, signal.SIGHUP,
           signal.SIGUSR1, signal.SIGUSR2}
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGPWR}

_LIBC = None


def _libc():  # type: ignore[no-untyped-def]
    """libc through ctypes, imported on first use (about 0.15 s under TCG)."""
    global _LIBC
    if _LIBC is None:
        import ctypes

        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


def log(msg: str) -> None:
    """One line on the console (fd 1), never raising."""
    try:
        os.write(1, f"hangar-init: {msg}\n".encode(errors="replace"))
    except OSError:
        pass


def mount(source: str, target: str, fstype: str, flags: int = 0, data: str = "") -> None:
    """mount(2); raises OSError."""
    import ctypes

    rc = _libc().mount(source.encode(), target.encode(), fstype.encode() if fstype else None,
                       ctypes.c_ulong(flags), data.encode() if data else None)
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount {fstype} on {target}: {os.strerror(e)}")


def mount_all() -> None:
    for source, target, fstype, flags, data, required in MOUNTS:
        try:
            if os.path.ismount(target):
                continue
            os.makedirs(target, exist_ok=True)
            try:
                mount(source, target, fstype, flags, data)
            except OSError as e:
                if fstype != "cgroup2" or e.errno != errno.EINVAL:
                    raise
                mount(source, target, fstype, flags)  # favordynmods: Linux 6.0+
        except OSError as e:
            if required:
                log(f"warning: {e}")
    for link, target in DEV_LINKS.items():
        try:
            os.symlink(target, link)
        except OSError:
            pass
    os.makedirs(paths.RUN_DIR, exist_ok=True)


def console_fds() -> None:
    """Make fds 0, 1, 2 the console (they already are after the initramfs; be sure)."""
    try:
        fd = os.open(CONSOLE, os.O_RDWR | os.O_NOCTTY)
    except OSError:
        return
    for n in (0, 1, 2):
        if n != fd:
            os.dup2(fd, n)
    if fd > 2:
        os.close(fd)


def parse_cmdline(text: str) -> dict[str, str]:
    """The ``key=value`` words of a kernel command line (a bare word maps to ``""``)."""
    out: dict[str, str] = {}
    for word in text.split():
        key, _, value = word.partition("=")
        out[key] = value
    return out


def set_hostname(name: str) -> None:
    for failure in identity.set_hostname(name):
        log(f"warning: cannot set the hostname: {failure}")


def fresh_identity() -> None:
    """A machine-id of this boot's own and fork generation 0 (``hangar.guest.identity``)."""
    try:
        identity.set_machine_id(identity.new_machine_id())
    except OSError as e:
        log(f"warning: cannot write {identity.MACHINE_ID}: {e}")
    try:
        identity.write_generation(0)
    except OSError as e:
        log(f"warning: cannot write {identity.GENERATION_FILE}: {e}")


def loopback_up() -> None:
    """``ip link set lo up`` unless it is up: two ioctls (SIOCGIFFLAGS, SIOCSIFFLAGS)."""
    try:
        with open("/sys/class/net/lo/flags") as f:
            if int(f.read(), 16) & 1:  # IFF_UP
                return
    except (OSError, ValueError):
        pass
    import _socket
    import fcntl
    import struct

    s = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM)
    try:
        ifr = fcntl.ioctl(s, 0x8913, struct.pack("16sH22x", b"lo", 0))
        flags = struct.unpack_from("16sH", ifr)[1]
        fcntl.ioctl(s, 0x8914, struct.pack("16sH22x", b"lo", flags | 1))
    except OSError as e:
        log(f"warning: cannot bring lo up: {e}")
    finally:
        s.close()


def fork_agent(env: dict[str, str]) -> int:
    """Fork; the child becomes the agent and never returns. Returns the child's pid.

    The child leaves this process's session and signal mask (it starts a
    session of its own with every signal unblocked), takes stdin from
    /dev/null and ``env`` as its environment, and imports and runs
    ``AGENT_MODULE`` (asyncio without ``ssl``, which it would import for
    nothing: each import costs about 25 times its native time under TCG). It
    exits with the agent's exit status (``SystemExit`` as the interpreter
    would, 1 on any other exception). PID 1 is single-threaded, so the fork
    is safe. Raises OSError when the fork fails.
    """
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.setsid()
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.environ.clear()
        os.environ.update(env)
        signal.pthread_sigmask(signal.SIG_SETMASK, ())
        sys.modules["ssl"] = None  # type: ignore[assignment]
        __import__(AGENT_MODULE)
        sys.modules[AGENT_MODULE].main()
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 -- the child must never return into PID 1's code
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def mark(step: str) -> None:
    """Append ``<step> <uptime>`` to ``BOOT_MARKS``, never raising."""
    try:
        with open(BOOT_MARKS, "a") as f:
            f.write(f"{step} {time.clock_gettime(time.CLOCK_BOOTTIME):.3f}\n")
    except OSError:
        pass


def describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"exit {os.waitstatus_to_exitcode(status)}"


class Init:
    """The state of PID 1: the agent's pid and restart schedule."""

    def __init__(self, cmdline: dict[str, str]) -> None:
        self.cmdline = cmdline
        self.env = dict(ENV)
        self.agent_env = dict(ENV, PYTHONPATH=PYTHON_DIR)
        self.agent_pid: int | None = None
        self.agent_started_at = 0.0
        self.agent_failures = 0
        self.agent_restart_at: float | None = 0.0
        self.announced = False
        self.poweroff_at: float | None = None
        after = cmdline.get("hangar.poweroff_after")
        if after:
            try:
                self.poweroff_at = time.monotonic() + float(after)
            except ValueError:
                log(f"warning: bad hangar.poweroff_after={after!r}")

    def start_agent(self) -> None:
        try:
            self.agent_pid = fork_agent(self.agent_env)
        except OSError as e:
            log(f"cannot start the agent: {e}")
            self.agent_pid = None
            self.schedule_restart()
            return
        self.agent_started_at = time.monotonic()
        self.agent_restart_at = None
        if not self.announced:
            mark("agent")
            log(f"agent pid {self.agent_pid} at uptime "
                f"{time.clock_gettime(time.CLOCK_BOOTTIME):.2f} s")
            log("agent started")
            self.announced = True
        else:
            log(f"agent restarted (pid {self.agent_pid})")

    def schedule_restart(self) -> None:
        if time.monotonic() - self.agent_started_at >= BACKOFF_RESET_S:
            self.agent_failures = 0
        delay = min(BACKOFF_FIRST_S * (2 ** self.agent_failures), BACKOFF_MAX_S)
        self.agent_failures += 1
        self.agent_restart_at = time.monotonic() + delay
        log(f"restarting the agent in {delay:.2f} s")

    def grow_root(self) -> None:
        """Grow the root file system online to fill its (qcow2) disk.

        What ``resize2fs`` does for a mounted ext4, without its process:
        ``EXT4_IOC_RESIZE_FS`` on the mount with the device's size in blocks
        (the kernel's work, some tens of ms under TCG; starting resize2fs
        cost a few hundred more, taken from the agent's start).
        """
        if "hangar.overlay" in self.cmdline:
            return  # the root is an overlay; its writable drive is made at full size
        dev = self.cmdline.get("root", "/dev/vda")
        if not dev.startswith("/dev/") or not os.path.exists(dev):
            return
        try:
            import fcntl
            import struct

            with open(f"/sys/class/block/{os.path.basename(dev)}/size") as f:
                sectors = int(f.read())
            blocks = sectors * 512 // os.statvfs("/").f_frsize
            fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                fcntl.ioctl(fd, EXT4_IOC_RESIZE_FS, struct.pack("Q", blocks))
            finally:
                os.close(fd)
        except (OSError, ValueError) as e:
            log(f"warning: cannot grow the root file system: {e}")

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.agent_pid:
                log(f"agent (pid {pid}) ended: {describe(status)}")
                self.agent_pid = None
                self.schedule_restart()

    def run(self) -> None:
        self.start_agent()
        self.grow_root()
        from hangar.guest import desktop  # a no-op without hangar.desktop=; never raises

        desktop.start(self.cmdline)
        while True:
            now = time.monotonic()
            deadlines = [t for t in (self.agent_restart_at, self.poweroff_at) if t is not None]
            timeout = max(0.0, min(deadlines) - now) if deadlines else 3600.0
            info = signal.sigtimedwait(WATCHED, timeout)
            if info is not None and info.si_signo in STOP_SIGNALS:
                poweroff(f"signal {info.si_signo} from pid {info.si_pid}")
            self.reap()
            now = time.monotonic()
            if self.poweroff_at is not None and now >= self.poweroff_at:
                poweroff("hangar.poweroff_after on the kernel command line")
            if self.agent_pid is None and self.agent_restart_at is not None \
                    and now >= self.agent_restart_at:
                self.start_agent()


def _reap_all() -> bool:
    """Reap what has exited; True when no child is left."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return True
        if pid == 0:
            return False


def poweroff(reason: str) -> None:
    """Stop every process, sync, and power the VM off. Does not return."""
    log(f"powering off ({reason})")
    try:
        os.kill(-1, signal.SIGTERM)
    except OSError:
        pass
    deadline = time.monotonic() + SHUTDOWN_GRACE_S
    while not _reap_all() and time.monotonic() < deadline:
        signal.sigtimedwait({signal.SIGCHLD}, 0.05)
    try:
        os.kill(-1, signal.SIGKILL)
    except OSError:
        pass
    for _ in range(20):
        if _reap_all():
            break
        signal.sigtimedwait({signal.SIGCHLD}, 0.05)
    os.sync()
    try:
        mount("", "/", "", MS_REMOUNT | MS_RDONLY)
    except OSError:
        pass
    import ctypes

    _libc().reboot(ctypes.c_int(RB_POWER_OFF))
    log(f"reboot(RB_POWER_OFF) failed: {os.strerror(ctypes.get_errno())}")
    os._exit(1)


def main() -> None:
    if os.getpid() != 1:
        print("hangar.guest.init runs as PID 1 inside a Hangar guest only", file=sys.stderr)
        sys.exit(2)
    mark("init")
    signal.pthread_sigmask(signal.SIG_BLOCK, WATCHED)
    os.umask(0o022)
    os.chdir("/")
    os.environ.clear()
    os.environ.update(ENV)
    try:
        mount_all()
        console_fds()
        try:
            with open("/proc/cmdline") as f:
                cmdline = parse_cmdline(f.read())
        except OSError:
            cmdline = {}
        name = cmdline.get("hangar.hostname", "hangar")
        if not valid_hostname(name):
            log(f"warning: invalid hangar.hostname={name!r}; using 'hangar'")
            name = "hangar"
        set_hostname(name)
        fresh_identity()
        loopback_up()
        if "hangar.net" in cmdline:  # the NIC, before the agent: see hangar.guest.net
            from hangar.guest import net

            net.configure(f"hangar.net={cmdline['hangar.net']}")
        Init(cmdline).run()
    except BaseException as e:  # noqa: BLE001 -- PID 1 must not exit: that panics the kernel
        import traceback

        log(f"fatal: {e!r}")
        for line in traceback.format_exc().splitlines():
            log(line)
        poweroff("init failed")


if __name__ == "__main__":
    main()
