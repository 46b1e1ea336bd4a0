"""E2B's default user in a sandbox made through ``/e2b``: ``user`` (uid and gid 1000, home
``/home/user``, passwordless sudo), made at create through the guest's exec as root
(``add_user``), and the envd calls that run as it (``as_user``, ``user_of``, ``give``,
``owners``). A part of ``hangar.core.e2b``, E2B's dialect of core.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hangar.core.commands import Command
from hangar.core.e2b import DEFAULT_USER, ROOT, options, sandbox
from hangar.errors import GuestError, InvalidRequest, Unauthorized

if TYPE_CHECKING:
    from hangar.core.sandboxes import SandboxManager

log = logging.getLogger("hangar.e2b")

__all__ = ["DEFAULT_USER", "ROOT", "Owner", "add_user", "as_user", "give", "home", "owners",
           "unwrapped", "user_of"]

SETPRIV = "setpriv"
"""util-linux's ``setpriv``: sets the user, group and groups, then ``exec``s the command."""
SUDO_HELPER = "/usr/local/libexec/hangar/sudo-setpriv"
"""A set-user-id copy of ``setpriv`` that only the default user's group may run: the
``sudo`` of images without sudo (``/usr/local/bin/sudo``, ``USER_SETUP``)."""

SUDO_SHIM = f"""#!/bin/sh
# sudo for E2B's default user (made by Hangar: the image has no sudo). Runs COMMAND as
# root without a password, as E2B's passwordless sudo does. Takes -E -H -n -S -k -b -P
# (ignored), -u root, -i and -s (a login or plain shell), --.
login=; shell=
while [ $# -gt 0 ]; do
  case "$1" in
    -E|-H|-n|-S|-k|-b|-P|--preserve-env|--preserve-env=*|--non-interactive) shift ;;
    -u) [ "$2" = root ] || [ "$2" = 0 ] || {{ echo "sudo: only root is served" >&2; exit 1; }}; shift 2 ;;
    -uroot|--user=root) shift ;;
    -i|--login) login=1; shift ;;
    -s|--shell) shell=1; shift ;;
    --) shift; break ;;
    -*) echo "sudo: option $1 is not served" >&2; exit 1 ;;
    *) break ;;
  esac
done
[ $# -gt 0 ] || [ -n "$login$shell" ] || {{ echo "usage: sudo [-u root] [-i|-s] COMMAND" >&2; exit 1; }}
export HOME=/root USER=root LOGNAME=root SUDO_USER="$(id -un)"
if [ -n "$login" ]; then set -- /bin/sh -c 'cd /root && exec /bin/bash -l ${{1:+-c "$*"}}' sh "$@"
elif [ -n "$shell" ]; then set -- /bin/bash ${{1:+-c "$*"}}
fi
exec {SUDO_HELPER} --reuid=0 --regid=0 --init-groups -- "$@"
"""

USER_SETUP = f"""u={DEFAULT_USER}
command -v {SETPRIV} >/dev/null || {{ echo "no {SETPRIV} in the image" >&2; exit 3; }}
known=
while IFS=: read -r name _; do [ "$name" = $u ] && known=1; done < /etc/passwd
if [ -z "$known" ]; then
  sh=/bin/sh; [ -x /bin/bash ] && sh=/bin/bash
  echo "$u:x:1000:1000::/home/$u:$sh" >> /etc/passwd
  echo "$u:x:1000:" >> /etc/group
  [ -f /etc/shadow ] && echo "$u:!:20000:0:99999:7:::" >> /etc/shadow
  [ -f /etc/gshadow ] && echo "$u:!::" >> /etc/gshadow
  install -d -o 1000 -g 1000 -m 0755 /home/$u || exit 1
  skel=
  for f in /etc/skel/.[!.]* /etc/skel/*; do [ -f "$f" ] && skel="$skel $f"; done
  [ -z "$skel" ] || install -o 1000 -g 1000 -m 0644 $skel /home/$u/ || exit 1
fi
if command -v sudo >/dev/null; then
  [ -d /etc/sudoers.d ] && echo "$u ALL=(ALL:ALL) NOPASSWD: ALL" > /etc/sudoers.d/90-hangar-$u
else
  install -D -o 0 -g 1000 -m 4750 "$(command -v {SETPRIV})" {SUDO_HELPER} || exit 1
  cat > /usr/local/bin/sudo <<'SHIM' && chmod 0755 /usr/local/bin/sudo || exit 1
{SUDO_SHIM}SHIM
fi
exit 0
"""
"""Run as root in a new sandbox made through ``/e2b`` (idempotent): the default user (uid and
gid 1000) with its group and home (written into ``/etc/passwd`` and its siblings by the
shell itself, with ``/etc/skel``'s files: few processes, each costly under emulation), and
passwordless ``sudo`` (a sudoers entry, or the ``SUDO_SHIM`` where the image has none).
Exits 3 when the image has no ``setpriv``, without which commands cannot run as it."""

SETUP_TIMEOUT_S = 60.0
"""Longest the default user's setup may take (a few small commands; an emulated guest on a
busy host is slow)."""


async def add_user(manager: SandboxManager, sandbox_id: str) -> str:
    """Make E2B's default user in a new sandbox's guest (``USER_SETUP``), give it the top
    folder of each read-write volume mounted there, and return the user
    its envd calls default to: ``DEFAULT_USER``, or ``root`` where the image cannot run
    commands as another user (no ``setpriv``; the record's options are changed to say so,
    and a warning is logged). Raises GuestError (the setup failed otherwise) and the guest
    call's errors."""
    rec = sandbox(manager, sandbox_id)
    opts = options(rec)
    if opts is None or opts.user != DEFAULT_USER:
        return ROOT
    r = await manager.exec(sandbox_id, Command(USER_SETUP, timeout_s=SETUP_TIMEOUT_S))
    if r.exit_code == 3:
        log.warning("E2B's default user not made: the image has no setpriv; envd runs as "
                    "root", extra={"sandbox_id": sandbox_id, "image": rec.image})
        manager.store.update(sandbox_id, e2b={**(rec.e2b or {}), "user": ROOT})
        return ROOT
    if r.exit_code != 0:
        why = (r.stderr.head or r.stdout.head).decode("utf-8", "replace").strip()[:300]
        raise GuestError(f"E2B's default user {DEFAULT_USER!r} could not be made in sandbox "
                         f"{sandbox_id}: {why or f'exit {r.exit_code}'}", sandbox_id=sandbox_id)
    # the top folder of each read-write volume is the default user's, as a write of that
    # user leaves what it makes (an E2B program writes into its volume without sudo)
    mounts = [a.path for a in manager.store.attachments(sandbox_id) if not a.read_only]
    await give(manager, sandbox_id, mounts, DEFAULT_USER)
    return DEFAULT_USER


def home(user: str) -> str:
    """The home folder of ``user`` (``root`` or ``DEFAULT_USER``) in the guest."""
    return "/root" if user == ROOT else f"/home/{user}"


def user_of(manager: SandboxManager, sandbox_id: str, named: str) -> str:
    """The user an envd call runs as: ``named`` (``root``, or ``DEFAULT_USER`` where the
    sandbox has it), else the sandbox's default. Raises Unauthorized for another user (E2B's
    envd answers an unknown user so), NotFound or Gone (no such sandbox)."""
    opts = options(sandbox(manager, sandbox_id))
    default = opts.user if opts is not None else ROOT
    if not named:
        return default
    if named == ROOT or (named == DEFAULT_USER and default == DEFAULT_USER):
        return named
    raise Unauthorized(f"invalid username: {named[:64]!r} (this sandbox has "
                       f"{', '.join(sorted({ROOT, default}))})", sandbox_id=sandbox_id)


def as_user(cmd: Command, user: str) -> Command:
    """``cmd`` (an argv: ``args`` set) run as ``user``: through ``setpriv`` for another user
    than root, with its ``HOME``, ``USER`` and ``LOGNAME``, and its home as the default
    ``cwd``. Raises InvalidRequest for a shell command (no ``args``) of another user."""
    if user == ROOT:
        return cmd
    if cmd.args is None or cmd.command is None:
        raise InvalidRequest("a command of another user than root is an argv")
    env = {"HOME": home(user), "USER": user, "LOGNAME": user, **(cmd.env or {})}
    return Command(command=SETPRIV, args=[f"--reuid={user}", f"--regid={user}",
                                          "--init-groups", "--", cmd.command, *cmd.args],
                   env=env, cwd=cmd.cwd or home(user), timeout_s=cmd.timeout_s,
                   head=cmd.head, tail=cmd.tail)


def unwrapped(command: str, args: list[str]) -> tuple[str, list[str]]:
    """The command and args a client asked for, of a process ``as_user`` started (what the
    guest lists is ``setpriv``'s argv)."""
    if command == SETPRIV and "--" in args and args and args[0].startswith("--reuid="):
        rest = args[args.index("--") + 1:]
        if rest:
            return rest[0], rest[1:]
    return command, args


@dataclass(frozen=True)
class Owner:
    """Who owns a path in the guest, by name, and where a symlink points (its absolute
    target, and the type of what it reaches: ``file``, ``dir``, or None when dangling)."""

    owner: str
    group: str
    target: str | None = None
    target_type: str | None = None


OWNERS_BATCH = 500
"""Paths asked about in one command."""
_OWNER_SH = ('for p; do if [ -L "$p" ]; then t=$(readlink -f -- "$p" || true); '
             'k=; [ -d "$p" ] && k=dir; [ -f "$p" ] && k=file; else t=; k=; fi; '
             'printf "%s\\t%s\\t%s\\t%s\\0" "$(stat -c %U:%G -- "$p")" "$p" "$t" "$k"; done')


async def owners(manager: SandboxManager, sandbox_id: str,
                 paths: list[str]) -> dict[str, Owner]:
    """The ``Owner`` of each absolute path of ``paths`` that exists, read in the guest (one
    short command per ``OWNERS_BATCH`` paths). Raises the guest call's errors."""
    out: dict[str, Owner] = {}
    for i in range(0, len(paths), OWNERS_BATCH):
        batch = paths[i:i + OWNERS_BATCH]
        r = await manager.exec(sandbox_id, Command(
            command="/bin/sh", args=["-c", _OWNER_SH, "sh", *batch], timeout_s=60,
            head=1 << 20))
        for item in r.stdout.head.split(b"\0"):
            parts = item.decode("utf-8", "replace").split("\t")
            if len(parts) != 4 or ":" not in parts[0]:
                continue
            owner, _, group = parts[0].partition(":")
            out[parts[1]] = Owner(owner, group, parts[2] or None, parts[3] or None)
    return out


async def give(manager: SandboxManager, sandbox_id: str, paths: list[str], user: str) -> None:
    """Make ``user`` (not root) the owner of ``paths`` (absolute), as envd's writes as that
    user leave them. Raises GuestError (chown failed) and the guest call's errors."""
    if user == ROOT or not paths:
        return
    r = await manager.exec(sandbox_id, Command(
        command="chown", args=["-h", f"{user}:{user}", "--", *paths], timeout_s=60))
    if r.exit_code != 0:
        why = r.stderr.head.decode("utf-8", "replace").strip()[:300]
        raise GuestError(f"cannot give {paths[0]} to {user}: {why}", sandbox_id=sandbox_id)
