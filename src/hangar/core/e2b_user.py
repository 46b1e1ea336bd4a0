"""E2B's default user in a sandbox made through ``/e2b``: ``user`` (uid and gid 1000, home
``/home/user``, passwordless sudo), made in every image's template snapshot before it is
saved (``hangar.core.templates``), else at create through the guest's exec as root
(``add_user``), and the envd calls that run as it (``as_user``, ``user_for``, ``give``,
``owners``). A part of ``hangar.core.e2b``, E2B's dialect of core.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hangar import json_items
from hangar.core import interpreter, templates
from hangar.core.commands import Command
from hangar.core.e2b import DEFAULT_USER, ROOT, Options, envs, options, sandbox
from hangar.errors import GuestError, InvalidRequest, Unauthorized

if TYPE_CHECKING:
    from hangar.core.sandboxes import SandboxManager

log = logging.getLogger("hangar.e2b")

__all__ = ["DEFAULT_USER", "METADATA_XATTR", "ROOT", "Owner", "add_user", "as_user", "prepare",
           "check_metadata", "give", "home", "owners", "unwrapped", "user_for"]

SETPRIV = "setpriv"
"""util-linux's ``setpriv``: sets the user, group and groups, then ``exec``s the command
(the ``SUDO_HELPER``'s program; the envd's commands of the default user ran through it
before the guest agent took the user itself, ``as_user``)."""
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
  mkdir -p /usr/local/bin || exit 1
  cat > /usr/local/bin/sudo <<'SHIM' && chmod 0755 /usr/local/bin/sudo || exit 1
{SUDO_SHIM}SHIM
fi
if ! command -v python >/dev/null && py=$(command -v python3); then
  ln -s "$py" /usr/local/bin/python 2>/dev/null || :
fi
exit 0
"""
"""Run as root in a new sandbox made through ``/e2b`` (idempotent): the default user (uid and
gid 1000) with its group and home (written into ``/etc/passwd`` and its siblings by the
shell itself, with ``/etc/skel``'s files: few processes, each costly under emulation), and
passwordless ``sudo`` (a sudoers entry, or the ``SUDO_SHIM`` where the image has none),
and ``python`` as E2B's templates have it: a link to ``python3`` where the image has only
that. Exits 3 when the image has no ``setpriv`` (the ``SUDO_SHIM``'s set-user-id program;
envd then keeps root as its default)."""

SETUP_TIMEOUT_S = 60.0
"""Longest the default user's setup may take (a few small commands; an emulated guest on a
busy host is slow)."""


async def add_user(manager: SandboxManager, sandbox_id: str, made: str | None = None) -> str:
    """Make E2B's default user in a new sandbox's guest (``USER_SETUP``; nothing to run
    when its template snapshot made it, ``hangar.core.templates.E2B_USER_FILE``, or when
    ``made`` says who did: ``DEFAULT_USER`` for a template built here, whose build
    sandbox had it), give it
    the top folder of each read-write volume mounted there, and return the user
    its envd calls default to: ``DEFAULT_USER``, or ``root`` where the image cannot run
    commands as another user (no ``setpriv``; the record's options are changed to say so,
    and a warning is logged). Raises GuestError (the setup failed otherwise) and the guest
    call's errors."""
    rec = sandbox(manager, sandbox_id)
    opts = options(rec)
    if opts is None or opts.user != DEFAULT_USER:
        return ROOT
    mounts = [a.path for a in manager.store.attachments(sandbox_id) if not a.read_only]
    rt = manager.registry.get(sandbox_id)
    if made is None:
        made = templates.e2b_user(rt.template) if rt is not None and rt.template else None
    if made == DEFAULT_USER and not mounts:
        return DEFAULT_USER  # its template made it (``hangar.core.templates``): no exec
    r = (await manager.exec(sandbox_id, Command(USER_SETUP, timeout_s=SETUP_TIMEOUT_S))
         if made is None else None)
    if made == ROOT or (r is not None and r.exit_code == 3):
        log.warning("E2B's default user not made: the image has no setpriv; envd runs as "
                    "root", extra={"sandbox_id": sandbox_id, "image": rec.image})
        manager.store.update(sandbox_id, e2b={**(rec.e2b or {}), "user": ROOT})
        return ROOT
    if r is not None and r.exit_code != 0:
        why = (r.stderr.head or r.stdout.head).decode("utf-8", "replace").strip()[:300]
        raise GuestError(f"E2B's default user {DEFAULT_USER!r} could not be made in sandbox "
                         f"{sandbox_id}: {why or f'exit {r.exit_code}'}", sandbox_id=sandbox_id)
    # the top folder of each read-write volume is the default user's, as a write of that
    # user leaves what it makes (an E2B program writes into its volume without sudo)
    await give(manager, sandbox_id, mounts, DEFAULT_USER)
    return DEFAULT_USER


async def prepare(manager: SandboxManager, sandbox_id: str, made: str | None = None) -> str:
    """What a create through ``/e2b`` does before the sandbox is handed out: ``add_user``,
    then, where the sandbox runs a code interpreter, its kernels moved to that user (its
    home as their folder) and the create's ``envVars`` (``interpreter.configure``), as
    E2B's code interpreter runs them. Returns the user, as ``add_user``; raises as it and as
    ``interpreter.configure``."""
    user = await add_user(manager, sandbox_id, made)
    await interpreter.configure(manager, sandbox_id, None if user == ROOT else user,
                                envs(manager, sandbox_id))
    return user


def home(user: str) -> str:
    """The home folder of ``user`` (``root`` or ``DEFAULT_USER``) in the guest."""
    return "/root" if user == ROOT else f"/home/{user}"


def user_for(opts: Options | None, named: str, sandbox_id: str) -> str:
    """The user an envd call to a sandbox whose options are ``opts`` (None: made through
    Hangar's own API) runs as: ``named`` (``root``, or ``DEFAULT_USER`` where the sandbox
    has it), else the sandbox's default. Raises Unauthorized for another user (E2B's envd
    answers an unknown user so)."""
    default = opts.user if opts is not None else ROOT
    if not named:
        return default
    if named == ROOT or (named == DEFAULT_USER and default == DEFAULT_USER):
        return named
    raise Unauthorized(f"invalid username: {named[:64]!r} (this sandbox has "
                       f"{', '.join(sorted({ROOT, default}))})", sandbox_id=sandbox_id)


def as_user(cmd: Command, user: str) -> Command:
    """``cmd`` run as ``user``: for another user than root, the guest agent itself takes
    that user's uid, gid and groups when it starts the command (``Command.user``,
    ``hangar.guest.users``: no program in between), with its ``HOME``, ``USER`` and
    ``LOGNAME`` under ``cmd``'s env and its home as the default ``cwd``."""
    if user == ROOT:
        return cmd
    return dataclasses.replace(cmd, user=user)


def unwrapped(command: str, args: list[str]) -> tuple[str, list[str]]:
    """The command and args a client asked for, of a process listed by the guest: its own
    argv, or, for one started through ``setpriv`` (as commands of the default user were
    before the guest agent took the user itself: a process of an agent saved then), the
    argv after ``setpriv``'s."""
    if command == SETPRIV and "--" in args and args and args[0].startswith("--reuid="):
        rest = args[args.index("--") + 1:]
        if rest:
            return rest[0], rest[1:]
    return command, args


@dataclass(frozen=True)
class Owner:
    """Who owns a path in the guest, by name, where a symlink points (its absolute target,
    and the type of what it reaches: ``file``, ``dir``, or None when dangling), and its
    E2B file metadata (``METADATA_XATTR`` extended attributes, the prefix stripped; None
    when it has none, or the image has no ``python3`` to read them)."""

    owner: str
    group: str
    target: str | None = None
    target_type: str | None = None
    metadata: dict[str, str] | None = None


OWNERS_BATCH = 500
"""Paths asked about in one command."""
METADATA_XATTR = "user.e2b."
"""The extended attributes' namespace of E2B's file metadata (a key ``k`` is ``user.e2b.k``)."""
METADATA_KEY_MAX = 255 - len(METADATA_XATTR)
"""Longest metadata key, bytes (the kernel's xattr name limit less the prefix)."""
METADATA_MAX = 4096
"""Most bytes of one file's metadata: keys with their prefix, plus values."""
_OWNER_PY = (
    "import grp,json,os,pwd,stat,sys\n"
    "def nm(f,i):\n"
    " try: return f(i)[0]\n"
    " except KeyError: return 'UNKNOWN'\n"
    "o=sys.stdout.buffer\n"
    "for p in sys.argv[1:]:\n"
    " try: s=os.lstat(p)\n"
    " except OSError: continue\n"
    " t=k=''\n"
    " if stat.S_ISLNK(s.st_mode):\n"
    "  t=os.path.realpath(p)\n"
    "  k='dir' if os.path.isdir(p) else 'file' if os.path.isfile(p) else ''\n"
    " m={}\n"
    " try:\n"
    "  for a in os.listxattr(p,follow_symlinks=False):\n"
    f"   if a.startswith({METADATA_XATTR!r}): m[a[{len(METADATA_XATTR)}:]]="
    "os.getxattr(p,a,follow_symlinks=False).decode('utf-8','replace')\n"
    " except OSError: pass\n"
    " o.write(('%s:%s\\t%s\\t%s\\t%s\\t%s\\0'%(nm(pwd.getpwuid,s.st_uid),"
    "nm(grp.getgrgid,s.st_gid),p,t,k,json.dumps(m) if m else ''))"
    ".encode('utf-8','surrogateescape'))\n")
"""Owners, symlinks and metadata of the paths in ``argv`` in one process, as ``_OWNER_SH``'s
loop prints them with a fifth field: the metadata as a JSON object (empty when none)."""
_OWNER_PL = (
    "use Config; use Cwd 'abs_path'; my %n=(x86_64=>[192,195],aarch64=>[9,12]); "
    "my ($g,$l)=@{$n{(split /-/,$Config{archname})[0]} || [0,0]}; "
    "for my $p (@ARGV) { my @s=lstat($p) or next; my ($t,$k)=('',''); "
    "if (-l _) { $t=abs_path($p); if (!defined $t) { $t=readlink($p) // ''; "
    "$t=($p=~m{^(.*)/} ? \"$1/\" : '').$t unless $t=~m{^/} } "
    "$k=-d $p ? 'dir' : -f $p ? 'file' : '' } "
    "if ($l) { my $b=\"\\0\"x65536; my $c=syscall($l,$p,$b,65536); if ($c>0) { my @o; "
    "for my $x (split /\\0/, substr($b,0,$c)) { "
    f"next unless $x=~s/^{re.escape(METADATA_XATTR)}//s; my $v=\"\\0\"x65536; "
    f"my $m=syscall($g,$p,\"{METADATA_XATTR}$x\",$v,65536); "
    "push @o, unpack('H*',$x).':'.unpack('H*',substr($v,0,$m)) if $m>=0 } "
    "print \"M\\t$p\\t\", join(',',@o), \"\\0\" if @o } } "
    "my ($u,$r)=(scalar getpwuid($s[4]), scalar getgrgid($s[5])); "
    "print +($u // 'UNKNOWN').':'.($r // 'UNKNOWN').\"\\t$p\\t$t\\t$k\\0\" }")
"""Owners, symlinks and metadata of the paths in ``argv`` in one perl process (perl starts in
a few milliseconds where python3 takes a tenth of a second, a second under emulation, and
``stat`` per path a tenth of a second each under emulation): a ``M<TAB>path<TAB>hexkey:hexvalue,...``
record (``lgetxattr`` and ``llistxattr`` by ``syscall``) before the owner record of a path
that has metadata, then ``owner:group<TAB>path<TAB>symlink target<TAB>its type``."""
_OWNER_SH = ('py=$1 pl=$2; shift 2; '
             'if command -v perl >/dev/null && perl -e "$pl" -- "$@"; then exit 0; fi; '
             'if command -v python3 >/dev/null; then exec python3 -I -S -c "$py" "$@"; fi; '
             'for p; do if [ -L "$p" ]; then t=$(readlink -f -- "$p" || true); '
             'k=; [ -d "$p" ] && k=dir; [ -f "$p" ] && k=file; else t=; k=; fi; '
             'printf "%s\\t%s\\t%s\\t%s\\0" "$(stat -c %U:%G -- "$p")" "$p" "$t" "$k"; done')
"""Owners and symlinks of the paths in ``argv`` (``owner:group``, path, symlink target, its
type), with their metadata: all of it from ``_OWNER_PL`` where the image has perl (and it
runs), else from ``_OWNER_PY`` where it has python3, else from ``stat`` per path, without
metadata."""


async def owners(manager: SandboxManager, sandbox_id: str, paths: list[str],
                 max_pairs: int | None = None) -> dict[str, Owner]:
    """The ``Owner`` of each absolute path of ``paths`` that exists, read in the guest (one
    short command per ``OWNERS_BATCH`` paths). With ``max_pairs``, stops asking once the
    paths read so far hold more than that many metadata pairs (``metadata_pairs``: the
    caller, which refuses such an answer, then finds them over). Raises the guest call's
    errors."""
    out: dict[str, Owner] = {}
    pairs = 0
    for i in range(0, len(paths), OWNERS_BATCH):
        batch = paths[i:i + OWNERS_BATCH]
        r = await manager.exec(sandbox_id, Command(
            command="/bin/sh", args=["-c", _OWNER_SH, "sh", _OWNER_PY, _OWNER_PL, *batch],
            timeout_s=60, head=1 << 20, tail=0))
        if r.timed_out or r.exit_code != 0:  # what it printed would name some paths only
            raise GuestError(f"reading the owners of {len(batch)} paths in the guest "
                             f"{'timed out' if r.timed_out else f'failed ({r.exit_code})'}",
                             sandbox_id=sandbox_id)
        head = r.stdout.head
        if head.count(b"\0") > RECORDS_PER_PATH * len(batch):
            raise GuestError(f"the guest answered more owner records than the {len(batch)} "
                             "paths asked about", sandbox_id=sandbox_id)
        got, n = (_asked(head, batch) if len(head) <= RECORDS_ONLOOP
                  else await asyncio.to_thread(_asked, head, batch))
        out.update(got)
        pairs += n
        if max_pairs is not None and pairs > max_pairs:
            break
    return out


RECORDS_PER_PATH = 3
"""Records the owner reader prints a path at most: perl's two (its metadata's, then its
owner's), and python3's one after a perl that failed midway. A guest that prints more
(records of paths nobody asked about, to be kept and counted: review 29l H1, 0.6 s of the
loop and 400 MiB a ListDir) is answered with a GuestError, unparsed."""


def _asked(head: bytes, batch: list[str]) -> tuple[dict[str, Owner], int]:
    """``_records`` of ``head`` for the paths of ``batch`` only, and their metadata pairs
    (in the caller's worker thread for a large ``head``)."""
    wanted = set(batch)
    got = {p: o for p, o in _records(head).items() if p in wanted}
    return got, metadata_pairs(got)


RECORDS_ONLOOP = 4 << 10
"""The guest's owner records (up to 1 MiB) are parsed in a worker thread past this many
bytes, never on the event loop (review 29f M1)."""


def _records(head: bytes) -> dict[str, Owner]:
    """The ``Owner`` of each record ``_OWNER_SH`` printed (the guest's to write: anything
    not of its shape is skipped)."""
    out: dict[str, Owner] = {}
    found: dict[str, dict[str, str]] = {}
    for item in head.split(b"\0"):
        text = item.decode("utf-8", "replace")
        if text.startswith("M\t"):
            path, _, pairs = text[2:].rpartition("\t")
            found[path] = _hex_pairs(pairs)
            continue
        parts = text.split("\t")
        if len(parts) not in (4, 5) or ":" not in parts[0]:
            continue
        owner, _, group = parts[0].partition(":")
        if (len(owner) > NAME_MAX or len(group) > NAME_MAX or len(parts[2]) > PATH_MAX
                or parts[3] not in ("", "dir", "file")):
            continue  # no system makes such a record: a padded answer (review 29m M2)
        meta = _json_object(parts[4]) if len(parts) == 5 else found.get(parts[1])
        out[parts[1]] = Owner(owner, group, parts[2] or None, parts[3] or None,
                              _bounded(meta) or None)
    return out


NAME_MAX = 64
"""Longest user or group name an owner record may carry, characters (Debian's tools make
at most 32; ``UNKNOWN`` or a number otherwise)."""
PATH_MAX = 4096
"""Longest symlink target an owner record may carry, characters (Linux's ``PATH_MAX``)."""


METADATA_READ_KEYS = 64
"""Most metadata keys of one file read back from the guest (what a guest set itself is not
bound by ``check_metadata``): the first ones, up to ``METADATA_MAX`` characters in all."""


def _bounded(meta: dict[str, str] | None) -> dict[str, str] | None:
    """``meta`` cut to ``METADATA_READ_KEYS`` keys and ``METADATA_MAX`` characters."""
    if not meta:
        return meta
    out: dict[str, str] = {}
    total = 0
    for k, v in meta.items():
        total += len(k) + len(v)
        if len(out) >= METADATA_READ_KEYS or total > METADATA_MAX:
            break
        out[k] = v
    return out


def metadata_chars(who: dict[str, Owner]) -> int:
    """Characters of the metadata of all of ``who`` (a ListDir's budget counts them): one
    step a pair, so count ``metadata_pairs`` first."""
    return sum(len(k) + len(v) for o in who.values() for k, v in (o.metadata or {}).items())


def metadata_pairs(who: dict[str, Owner]) -> int:
    """Key-value pairs of the metadata of all of ``who``: one step a path."""
    return sum(len(o.metadata) for o in who.values() if o.metadata)


def _hex_pairs(text: str) -> dict[str, str]:
    """The first ``METADATA_READ_KEYS`` ``hexkey:hexvalue`` pairs of ``text``."""
    out: dict[str, str] = {}
    for pair in text.split(",", METADATA_READ_KEYS)[:METADATA_READ_KEYS]:
        k, _, v = pair.partition(":")
        try:
            out[bytes.fromhex(k).decode("utf-8", "replace")] = \
                bytes.fromhex(v).decode("utf-8", "replace")
        except ValueError:
            continue
    return out


def _json_object(text: str) -> dict[str, str] | None:
    """The JSON object ``text`` (values as strings), or None when it is not one or holds
    more than ``METADATA_READ_KEYS`` times four values (counted before it is parsed)."""
    if json_items.too_many(text.encode(), 4 * METADATA_READ_KEYS):
        return None
    try:
        value = json.loads(text) if text else None
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    return {str(k): str(v) for k, v in value.items()}


def check_metadata(metadata: dict[str, str]) -> dict[str, str]:
    """``metadata`` as it is stored: keys lowercased (the first of two keys that differ by
    case wins). Raises InvalidRequest (400) for a key or value that is not printable ASCII,
    an empty key or one over ``METADATA_KEY_MAX`` bytes, or more than ``METADATA_MAX`` bytes
    in all."""
    out: dict[str, str] = {}
    total = 0
    for key, value in metadata.items():
        k = key.lower()
        if not k or len(k) > METADATA_KEY_MAX or not _printable(k) or not _printable(value):
            raise InvalidRequest(f"metadata key {key[:64]!r}: keys (1 to {METADATA_KEY_MAX} "
                                 "bytes) and values must be printable US-ASCII",
                                 field="metadata")
        if k in out:
            continue
        out[k] = value
        total += len(METADATA_XATTR) + len(k) + len(value)
    if total > METADATA_MAX:
        raise InvalidRequest(f"the file metadata is {total} bytes, over the {METADATA_MAX} "
                             "bytes a file may hold (keys with their user.e2b. prefix, and "
                             "values)", field="metadata")
    return out


def _printable(text: str) -> bool:
    return all(0x20 <= ord(c) <= 0x7e for c in text)


_LABEL_PL = (
    "use Config; my %n=(x86_64=>189,aarch64=>6); "
    "my $s=$n{(split /-/,$Config{archname})[0]} or die \"no lsetxattr on this arch\\n\"; "
    "my ($u,$m,@p)=@ARGV; my @kv=map { [map { pack('H*',$_) } split /:/,$_,2] } "
    "grep { length } split /,/,$m; my @w=$u eq 'root' ? () : (getpwnam($u))[2,3]; "
    "for my $p (@p) { if (@w) { chown($w[0],$w[1],$p) or die \"cannot give $p to $u: $!\\n\" } "
    "for my $e (@kv) { "
    f"syscall($s,$p,\"{METADATA_XATTR}$e->[0]\",$e->[1],length($e->[1]),0)==0 "
    "or do { print STDERR \"$p: $!\\n\"; exit 4 } } }")
"""Give the paths after ``argv[1]`` to ``argv[0]`` (unless root) and set the metadata
(``argv[1]``: ``hexkey:hexvalue,...``) on them: perl's ``syscall`` of ``lsetxattr``; exits
4 when the filesystem refuses the attributes."""
_LABEL_PY = (
    "import os,pwd,sys\n"
    "u,m=sys.argv[1],[p.split(':') for p in sys.argv[2].split(',') if p]\n"
    "w=pwd.getpwnam(u) if u!='root' else None\n"
    "for p in sys.argv[3:]:\n"
    " if w: os.lchown(p,w.pw_uid,w.pw_gid)\n"
    " try:\n"
    f"  for k,v in m: os.setxattr(p,{METADATA_XATTR!r}+bytes.fromhex(k).decode(),"
    "bytes.fromhex(v),follow_symlinks=False)\n"
    " except OSError as e: print(p+': '+e.strerror,file=sys.stderr); sys.exit(4)\n")
"""``_LABEL_PL`` where the image has python3 and no perl."""
_LABEL_SH = ('pl=$1 py=$2; shift 2; command -v perl >/dev/null && exec perl -e "$pl" -- "$@"; '
             'command -v python3 >/dev/null && exec python3 -I -S -c "$py" "$@"; '
             'echo "the image has neither perl nor python3, which file metadata needs" >&2; '
             'exit 3')


async def give(manager: SandboxManager, sandbox_id: str, paths: list[str], user: str,
               metadata: dict[str, str] | None = None) -> None:
    """Make ``user`` (not root) the owner of ``paths`` (absolute), as envd's writes as that
    user leave them, and set ``metadata`` (checked by ``check_metadata``) on each as
    ``METADATA_XATTR`` attributes (that needs perl or python3 in the image). Raises
    InvalidRequest (400: the filesystem refuses the attributes; the files are written and
    given), GuestError (chown failed, or no perl or python3) and the guest call's errors."""
    if not paths or (user == ROOT and not metadata):
        return
    if metadata:
        pairs = ",".join(f"{k.encode().hex()}:{v.encode().hex()}" for k, v in metadata.items())
        cmd = Command(command="/bin/sh", args=["-c", _LABEL_SH, "sh", _LABEL_PL, _LABEL_PY,
                                                user, pairs, *paths], timeout_s=60)
    else:
        cmd = Command(command="chown", args=["-h", f"{user}:{user}", "--", *paths],
                      timeout_s=60)
    r = await manager.exec(sandbox_id, cmd)
    if metadata and r.exit_code == 4:
        why = (r.stderr.head or r.stderr.tail).decode("utf-8", "replace").strip()
        raise InvalidRequest(f"the file is written, but its metadata cannot be kept there "
                             f"({why[-300:]}): that filesystem takes no user extended "
                             "attributes (tmpfs on this guest's kernel: /tmp, /dev/shm) or has "
                             "no room for these", field="metadata")
    if r.exit_code != 0:
        why = (r.stderr.head or r.stderr.tail).decode("utf-8", "replace").strip()
        raise GuestError(f"cannot give {paths[0]} to {user}"
                         f"{' with its metadata' if metadata else ''}: {why[-300:]}",
                         sandbox_id=sandbox_id)
