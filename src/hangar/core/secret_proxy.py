"""Sandboxes' secret-injecting egress proxies: one ``mitmdump`` per running sandbox that
has secrets (docs/security.md, "Secrets and the vault").

mitmproxy (pinned in ``requirements-proxy.lock``) runs in a virtual environment of its
own, ``HANGAR_SECRET_PROXY_MITMDUMP`` (default: ``.venv-proxy/bin/mitmdump`` beside the
server's environment, which ``scripts/install.sh`` makes), with the addon
``hangar/core/secret_addon.py``. For a sandbox, ``SecretProxies.start``:

1. writes its CA (``make_ca``; kept sealed in the vault) to a confdir of its own,
   ``<data>/secret-proxies/<id>/mitmproxy-ca.pem`` (0600, in a 0700 folder), which
   mitmproxy signs the guest's per-host certificates with;
2. starts ``mitmdump`` in transparent mode on (the bridge gateway, a free port), quiet
   (no flow is printed), with an environment of its own (none of the server's), and
   hands it its secrets' values and egress rules on a pipe (``secret_addon``'s control
   pipe; the values are never written to a file);
3. waits for the addon's ``ready`` and then has the network manager send the guest's
   new connections to ports 80 and 443 to it (``NetworkManager.intercept``).

The addon's events (``secret.refused``: secret, host, reason; ``egress.denied``: domain,
address, port, reason, ``via`` ``secret_proxy``) are published as Hangar events with the
sandbox's id, repeats coalesced as the domain guard's are: names and hosts, never a value. ``stop`` ends the proxy
(the pipe closes, then SIGTERM, then SIGKILL) and removes its folder; a proxy whose
server is gone ends by itself (end of file on its pipe), and ``sweep`` ends any left
over at start (its command line names this data directory's proxies folder).

``install_ca_meta`` is the guest exec that makes the guest trust the CA.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from hangar.core.context import Context
from hangar.core.lifecycle import State
from hangar.core.secrets import Vault
from hangar.errors import ConfigError, EngineError
from hangar.log import redact
from hangar.net.egress import Coalescer

log = logging.getLogger("hangar.secrets")

ADDON = Path(__file__).with_name("secret_addon.py")
READY_S = 30.0
"""Seconds a new proxy has to say it serves (mitmdump starts in about 1 s idle)."""
STOP_S = 3.0
"""Seconds a proxy has to end after its pipe closes, before SIGKILL."""
RESTARTS = 3
"""Times a proxy that ended on its own is started again for one sandbox."""
DPORTS = (80, 443)
EVENTS = {"secret.refused", "egress.denied"}
"""Events of the addon published as Hangar events (anything else is logged)."""
ERR_LINES = 20
"""Lines of a proxy's stderr kept (filtered) for the error of a proxy that ended."""
ERR_LINE_MAX = 300
_PLACEHOLDER = re.compile(r"hangar-secret-[0-9a-zA-Z]*")
_QUERY = re.compile(r"\?[^\s\"']*")
_AUTH = re.compile(r"(?i)\b(authorization|proxy-authorization|cookie|x-api-key)\b\S*\s*[^,;]*")
_CGROUP_NOTE: str | None = None


def default_mitmdump() -> Path:
    """``.venv-proxy/bin/mitmdump`` beside the server's virtual environment."""
    return Path(sys.prefix).parent / ".venv-proxy" / "bin" / "mitmdump"


def mitmdump_argv(exe: Path, host: str, port: int, confdir: Path, max_body_bytes: int,
                  upstream_ca: Path | str | None = None) -> list[str]:
    """The command line of one sandbox's proxy: ``exe`` (mitmdump) in transparent mode on
    (``host``, ``port``), quiet, the addon loaded, its CA in ``confdir``, bodies that
    declare more than ``max_body_bytes`` refused; ``upstream_ca`` (tests only): the CAs
    trusted upstream instead of the public ones.

    ``websocket=false``: a WebSocket (after its HTTP 101) is relayed by mitmproxy's raw
    TCP layer, as bytes, both ways: never parsed into messages, assembled or inflated
    (``permessage-deflate``), which mitmproxy's WebSocket layer does without a bound,
    keeping every message for the connection's life (review 29k K-H2). The addon makes
    that layer keep nothing either (``secret_addon._flowless_tcp``). No secret is put
    into WebSocket messages or raw TCP bytes: they pass through unmodified."""
    argv = [str(exe), "--mode", "transparent", "--listen-host", host,
            "--listen-port", str(port), "-q", "-s", str(ADDON),
            "--set", f"confdir={confdir}", "--set", "flow_detail=0",
            "--set", "termlog_verbosity=error", "--set", "connection_strategy=lazy",
            "--set", "upstream_cert=false", "--set", "ssl_insecure=false",
            "--set", "onboarding=false", "--set", "websocket=false",
            "--set", f"body_size_limit={max_body_bytes}"]
    if upstream_ca:
        argv += ["--set", f"ssl_verify_upstream_trusted_ca={upstream_ca}"]
    return argv


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def host_addresses() -> list[str]:
    """The host's own IPv4 addresses as /32 CIDRs (``ip -j -4 addr``); [] when unknown."""
    try:
        out = subprocess.run(["ip", "-j", "-4", "addr"], capture_output=True, timeout=5,
                             check=True).stdout
        return sorted({f"{a['local']}/32" for link in json.loads(out)
                       for a in link.get("addr_info", ()) if a.get("local")})
    except (OSError, ValueError, subprocess.SubprocessError, KeyError, TypeError):
        return []


def match_rules(network: dict[str, Any] | None, never: list[str]) -> dict[str, Any]:
    """What the addon's ``decide`` gets for an egress policy (``Policy.match_rules``)."""
    from hangar.net import Policy

    return dict(Policy.parse(network or "none").match_rules(never=never))


def egress_match_path() -> str:
    """The net layer's stdlib-only matcher (``hangar/net/egress_match.py``), which the
    addon loads by path."""
    import hangar.net.egress_match

    return str(Path(hangar.net.egress_match.__file__))


@dataclass
class Proxy:
    """One running proxy: its process, port and pipes."""

    sandbox_id: str
    proc: subprocess.Popen[bytes]
    port: int
    control: Any
    confdir: Path
    events: Any = None
    """The read end of the addon's events pipe (a file object)."""
    network: dict[str, Any] | None = None
    reader: asyncio.Task[None] | None = None
    stderr: Any = None
    """The read end of mitmdump's stderr (a file object): never logged as it is."""
    err_reader: asyncio.Task[None] | None = None
    err_tail: list[str] = field(default_factory=list)
    """The last lines of its stderr, filtered (``_filter``)."""
    cgroup: Any = None
    """Its memory cgroup (``hangar.engines.cgroups.Group``), when one was made."""
    ready: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop()
                                        .create_future())


class SecretProxies:
    """The proxies of one server's sandboxes (see the module docstring)."""

    def __init__(self, ctx: Context, vault: Vault, net: Any) -> None:
        self.ctx = ctx
        self.vault = vault
        self.net = net
        self.root = ctx.layout.secret_proxies
        self.proxies: dict[str, Proxy] = {}
        self._never: list[str] | None = None
        self._restarts: dict[str, int] = {}
        self.coalescer = Coalescer()
        """One event per (sandbox, kind, fields) per 10 s, 20 per sandbox per 10 s, as
        the domain guard's (``hangar.net.egress``): a guest in a loop floods nothing."""
        self.guard: Any = None
        """The domain guard (``hangar.net.egress.EgressGuard``), when there is one."""

    def follow(self, guard: Any) -> None:
        """Take a sandbox's live rules from the domain ``guard`` (its DNS answers included)
        whenever they change."""
        self.guard = guard
        if guard is not None:
            guard.listeners.append(self._guard_changed)

    def claim(self, sandbox_id: str) -> None:
        """Before a NIC of a sandbox with secrets is guarded: its HTTP(S) goes to its own
        proxy (the guard redirects only its DNS)."""
        if self.guard is not None and self.vault.binding(sandbox_id) is not None:
            self.guard.external.add(sandbox_id)

    def _guard_changed(self, sandbox_id: str, rules: dict[str, Any] | None) -> None:
        if sandbox_id not in self.proxies:
            return
        if rules is None:  # no longer guarded: the rules of its stored policy
            rec = self.ctx.store.get(sandbox_id)
            self.update_policy(sandbox_id, rec.network if rec is not None else None)
        else:
            self.update_rules(sandbox_id, rules)

    @property
    def mitmdump(self) -> Path:
        return Path(self.ctx.settings.secret_proxy_mitmdump or default_mitmdump())

    # -- rules ------------------------------------------------------------------------------

    def never(self) -> list[str]:
        """Addresses no proxy connects to whatever a sandbox's rules say: the guests' network
        (the bridge's pool) and the host's own addresses (and, from the domain guard, a
        cluster's control endpoints)."""
        if self._never is None:
            pool = getattr(self.net, "pool", None)
            self._never = ([str(pool)] if pool is not None else []) + host_addresses()
        extra = list(self.guard.never()) if self.guard is not None else []
        return sorted(set(self._never) | set(extra))

    def rules_for(self, network: dict[str, Any] | None,
                  sandbox_id: str | None = None) -> dict[str, Any]:
        """The rules the addon's ``decide`` gets for a sandbox's egress policy: the domain
        guard's live ones (with the names it resolved) when it guards ``sandbox_id``."""
        live = self.guard.rules(sandbox_id) if self.guard is not None and sandbox_id else None
        return self.with_never(live) if live is not None else match_rules(network, self.never())

    def with_never(self, rules: dict[str, Any]) -> dict[str, Any]:
        """``rules`` with ``never`` (integer ranges) holding this proxy's ``never`` too,
        whoever made them."""
        extra = [[int(n.network_address), int(n.broadcast_address)]
                 for n in (ipaddress.IPv4Network(c, strict=False) for c in self.never())]
        out = dict(rules)
        out["never"] = [*out.get("never", []), *extra]
        return out

    # -- start and stop -----------------------------------------------------------------------

    async def start(self, sandbox_id: str, network: dict[str, Any] | None) -> int | None:
        """Start ``sandbox_id``'s proxy if it has secrets and is not proxied yet, and send
        its guest's web traffic there; its port, or None (no secrets). Raises EngineError
        (the proxy did not start; nothing is left), ConfigError (no mitmdump)."""
        if self.vault.binding(sandbox_id) is None:
            return None
        if sandbox_id in self.proxies:
            return self.proxies[sandbox_id].port
        if self.net is None or getattr(self.net, "mode", "") != "tap":
            raise ConfigError("secrets need TAP networking (HANGAR_NETWORK=tap, as root)")
        exe = self.mitmdump
        if not os.access(exe, os.X_OK):
            raise ConfigError(f"no mitmdump at {exe}: run scripts/install.sh (it makes the "
                              "proxy's environment) or set HANGAR_SECRET_PROXY_MITMDUMP")
        ca = self.vault.ca(sandbox_id)
        assert ca is not None
        confdir = self.root / sandbox_id
        shutil.rmtree(confdir, ignore_errors=True)
        self.root.mkdir(mode=0o700, exist_ok=True)
        confdir.mkdir(mode=0o700)
        fd = os.open(confdir / "mitmproxy-ca.pem", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(ca[1] + ca[0].encode())
        gateway = self.net.gateway
        port = free_port(gateway)
        ctl_r, ctl_w = os.pipe()
        ev_r, ev_w = os.pipe()
        err_r, err_w = os.pipe()
        argv = mitmdump_argv(exe, gateway, port, confdir,
                             self.ctx.settings.secret_proxy_max_body_bytes,
                             self.ctx.settings.secret_proxy_upstream_ca)
        env = {"PATH": "/usr/bin:/bin", "HOME": str(confdir), "LANG": "C.UTF-8",
               "HANGAR_PROXY_CONTROL_FD": str(ctl_r), "HANGAR_PROXY_EVENTS_FD": str(ev_w)}
        try:
            proc = subprocess.Popen(argv, env=env, cwd=confdir, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=err_w,
                                    pass_fds=(ctl_r, ev_w), start_new_session=True)
        except OSError as exc:
            for fd_ in (ctl_r, ctl_w, ev_r, ev_w, err_r, err_w):
                os.close(fd_)
            shutil.rmtree(confdir, ignore_errors=True)
            raise EngineError(f"the secret proxy did not start: {exc}",
                              sandbox_id=sandbox_id) from None
        os.close(ctl_r)
        os.close(ev_w)
        os.close(err_w)
        (confdir / "pid").write_text(f"{proc.pid}\n")
        control = os.fdopen(ctl_w, "w", buffering=1)
        proxy = Proxy(sandbox_id, proc, port, control, confdir,
                      os.fdopen(ev_r, "rb", buffering=0), network)
        proxy.stderr = os.fdopen(err_r, "rb", buffering=0)
        self.proxies[sandbox_id] = proxy
        self._confine(proxy)
        try:
            loop = asyncio.get_running_loop()
            proxy.reader = loop.create_task(self._read(proxy))
            proxy.err_reader = loop.create_task(self._read_stderr(proxy))
            self._send(proxy, {"secrets": self.vault.resolved(sandbox_id),
                               "rules": self.rules_for(network, sandbox_id),
                               "egress_match": egress_match_path(),
                               "max_connections":
                                   self.ctx.settings.secret_proxy_max_connections})
            try:
                await asyncio.wait_for(asyncio.shield(proxy.ready), READY_S)
            except asyncio.TimeoutError:
                raise EngineError(f"the secret proxy did not start within {READY_S:.0f} s: "
                                  f"{self._tail(proxy)}", sandbox_id=sandbox_id) from None
            await self.net.intercept_async(sandbox_id, port, DPORTS)
        except BaseException:
            await self.stop(sandbox_id)
            raise
        log.info("secret proxy started", extra={"sandbox_id": sandbox_id, "port": port,
                                                "pid": proc.pid})
        return port

    async def stop(self, sandbox_id: str, keep_rules: bool = False) -> None:
        """End ``sandbox_id``'s proxy, if any, and remove its folder; never raises.
        ``keep_rules``: leave its guest's web traffic sent to the (closed) port, so it is
        refused rather than sent direct until a server starts the proxy again."""
        proxy = self.proxies.pop(sandbox_id, None)
        if proxy is None:
            shutil.rmtree(self.root / sandbox_id, ignore_errors=True)
            return
        if self.guard is not None and not keep_rules:
            self.guard.external.discard(sandbox_id)
        if self.net is not None and not keep_rules:
            try:
                await self.net.intercept_async(sandbox_id, None, DPORTS)
            except Exception:
                pass  # the NIC (and its rules) may be gone already
        try:
            proxy.control.close()
        except OSError:
            pass
        await asyncio.get_running_loop().run_in_executor(None, self._end, proxy.proc)
        for task in (proxy.reader, proxy.err_reader):
            if task is not None:
                task.cancel()
        for f in (proxy.events, proxy.stderr):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass
        if proxy.cgroup is not None:
            from hangar.engines.cgroups import remove_dirs

            await remove_dirs(list(proxy.cgroup.dirs))
        shutil.rmtree(proxy.confdir, ignore_errors=True)
        log.info("secret proxy stopped", extra={"sandbox_id": sandbox_id})

    async def stop_all(self, keep_rules: bool = False) -> None:
        """End every proxy (the server is closing: ``keep_rules``)."""
        for sid in list(self.proxies):
            await self.stop(sid, keep_rules=keep_rules)

    @staticmethod
    def _end(proc: subprocess.Popen[bytes]) -> None:
        try:
            proc.wait(STOP_S)
            return
        except subprocess.TimeoutExpired:
            pass
        for sig, wait in ((signal.SIGTERM, STOP_S), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def sweep(self, keep: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        """End proxies a previous server left (their folders, pids checked against their
        command lines) but for ``keep``, and remove their folders."""
        if not self.root.is_dir():
            return
        for d in self.root.iterdir():
            if d.name in keep or d.name in self.proxies:
                continue
            try:
                pid = int((d / "pid").read_text().strip())
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                if f"confdir={d}".encode() in cmdline:
                    os.killpg(pid, signal.SIGKILL)
            except (OSError, ValueError):
                pass
            shutil.rmtree(d, ignore_errors=True)

    # -- while running ------------------------------------------------------------------

    def update_rules(self, sandbox_id: str, rules: dict[str, Any]) -> bool:
        """Give ``sandbox_id``'s proxy new egress rules (``rules_for``'s shape); they hold
        for the next connection. False when it has no proxy."""
        proxy = self.proxies.get(sandbox_id)
        if proxy is None:
            return False
        try:
            self._send(proxy, {"rules": self.with_never(rules)})
        except EngineError:  # it ended: _read starts it again, with the live rules
            return False
        return True

    def update_policy(self, sandbox_id: str, network: dict[str, Any] | None) -> bool:
        """``update_rules`` with the rules of egress policy ``network`` (as stored on the
        sandbox's record: ``Policy.model_dump``). False when it has no proxy."""
        if sandbox_id not in self.proxies:
            return False
        return self.update_rules(sandbox_id, self.rules_for(network, sandbox_id))

    def refresh(self) -> None:
        """Send every proxy its secrets again (after a rotation or a delete)."""
        for sid, proxy in list(self.proxies.items()):
            try:
                self._send(proxy, {"secrets": self.vault.resolved(sid)})
            except Exception as exc:
                log.warning("secret proxy not refreshed", extra={"sandbox_id": sid,
                                                                  "error": type(exc).__name__})

    @staticmethod
    def _send(proxy: Proxy, msg: dict[str, Any]) -> None:
        try:
            proxy.control.write(json.dumps(msg) + "\n")
        except (OSError, ValueError):
            raise EngineError("the secret proxy is gone", sandbox_id=proxy.sandbox_id) from None

    async def _read(self, proxy: Proxy) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 16)
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), proxy.events)
        try:
            while True:
                try:
                    line = await reader.readline()
                except ValueError:  # an over-long line: not the addon's
                    continue
                if not line:
                    break
                self._event(proxy, line)
        finally:
            transport.close()
            ended = not proxy.ready.done() or self.proxies.get(proxy.sandbox_id) is proxy
            if ended and proxy.err_reader is not None:  # its last words, for _tail
                await asyncio.wait({proxy.err_reader}, timeout=1.0)
            if not proxy.ready.done():
                proxy.ready.set_exception(EngineError(
                    f"the secret proxy ended: {self._tail(proxy)}", sandbox_id=proxy.sandbox_id))
                proxy.ready.exception()  # retrieved: nobody may wait
            elif self.proxies.get(proxy.sandbox_id) is proxy:  # it ended on its own
                loop.create_task(self._restart(proxy))

    async def _restart(self, proxy: Proxy) -> None:
        """A proxy that ended while its sandbox runs: logged, and started again (at most
        ``RESTARTS`` times per sandbox); meanwhile its guest's web traffic is refused."""
        sid = proxy.sandbox_id
        why = self._tail(proxy)
        await self.stop(sid, keep_rules=True)
        tries = self._restarts[sid] = self._restarts.get(sid, 0) + 1
        log.error("secret proxy ended", extra={"sandbox_id": sid, "error": why,
                                               "restart": tries <= RESTARTS})
        self.ctx.publish("secret.proxy_ended", sid, restarted=tries <= RESTARTS)
        rec = self.ctx.store.get(sid)
        if tries > RESTARTS or rec is None or rec.state not in (State.RUNNING,
                                                                  State.UNRESPONSIVE):
            return
        try:
            await self.start(sid, proxy.network)
        except Exception as exc:
            log.error("secret proxy not restarted", extra={"sandbox_id": sid,
                                                           "error": str(exc)[:300]})

    def _event(self, proxy: Proxy, line: bytes) -> None:
        try:
            ev = json.loads(line)
            kind = str(ev.pop("event"))
        except (ValueError, KeyError, TypeError, AttributeError):
            return
        if kind == "ready":
            if not proxy.ready.done():
                proxy.ready.set_result(None)
            return
        if kind == "proxy.busy":  # a connection over the cap, closed: counted, logged seldom
            if self.coalescer.admit(proxy.sandbox_id, (proxy.sandbox_id, kind)) is not None:
                log.info("secret proxy: a connection over the cap was closed", extra={
                    "sandbox_id": proxy.sandbox_id,
                    "max_connections": self.ctx.settings.secret_proxy_max_connections})
            return
        if kind not in EVENTS:
            log.warning("secret proxy: %s", kind[:64], extra={"sandbox_id": proxy.sandbox_id})
            return
        data: dict[str, Any] = {k: str(v)[:253] for k, v in ev.items() if k in (
            "secret", "host", "domain", "address", "reason")}
        sid = proxy.sandbox_id
        if kind == "egress.denied":
            data["port"] = int(ev["port"]) if isinstance(ev.get("port"), int) else 0
            data["via"] = "secret_proxy"
            try:
                self.ctx.metrics.egress_denied.labels("secret_proxy", data.get("reason", "")).inc()
            except AttributeError:  # a server without the egress metric
                pass
        held = self.coalescer.admit(sid, (sid, kind, *sorted(data.items())))
        if held is None:  # a repeat within the window: counted, not published
            return
        if held:
            data["repeats"] = held
        self.ctx.publish(kind, sid, **data)
        log.info(kind, extra={"sandbox_id": sid, **data})

    @staticmethod
    def _tail(proxy: Proxy) -> str:
        """The last line of the proxy's own error output, filtered (``_filter``)."""
        code = proxy.proc.poll()
        return (proxy.err_tail or [f"exit {code}" if code is not None else "no answer"])[-1]

    def _filter(self, sandbox_id: str, raw: bytes) -> str:
        """One line of mitmdump's stderr as it may be logged or shown: printable ASCII
        only, at most ``ERR_LINE_MAX`` characters, every secret value of the sandbox (and
        anything that looks like a placeholder) replaced by ``[secret]``, query strings
        and header-like values cut."""
        text = raw.decode("utf-8", "replace")
        try:
            values = [s.get("value", "") for s in self.vault.resolved(sandbox_id).values()]
        except Exception:
            values = []
        for v in values:
            if isinstance(v, str) and len(v) >= 4:
                text = text.replace(v, "[secret]")
        text = _PLACEHOLDER.sub("[secret]", text)
        text = _QUERY.sub("?[cut]", text)
        text = _AUTH.sub(r"\1 [cut]", text)
        text = "".join(c if " " <= c <= "~" else "?" for c in text)
        return redact(text.strip())[:ERR_LINE_MAX]

    async def _read_stderr(self, proxy: Proxy) -> None:
        """Keep the last ``ERR_LINES`` filtered lines of mitmdump's stderr (read from its
        pipe as they come, so it never blocks); nothing else of it is kept or logged."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 16)
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), proxy.stderr)
        try:
            while True:
                try:
                    line = await reader.readline()
                except ValueError:  # an over-long line: dropped
                    continue
                if not line:
                    break
                if line.strip():
                    proxy.err_tail.append(self._filter(proxy.sandbox_id, line))
                    del proxy.err_tail[:-ERR_LINES]
        finally:
            transport.close()

    def _confine(self, proxy: Proxy) -> None:
        """Bound the proxy's memory to ``secret_proxy_memory_mib``: always its
        ``RLIMIT_DATA`` (heap and private writable mappings; past it an allocation fails,
        and the connection that asked for it ends), and a memory cgroup of its own when this
        server may make cgroups (then the kernel's OOM killer ends the proxy, which is
        started again); else it runs without a cgroup (logged once). Not the service's
        ``MemoryMax=``: VMMs without a cgroup of their own (and, on cgroup v1, all of them)
        are in the service's cgroup too (deploy/hangar.service)."""
        global _CGROUP_NOTE
        from hangar.engines.cgroups import Hierarchy, Limits

        limit = self.ctx.settings.secret_proxy_memory_mib << 20
        try:
            resource.prlimit(proxy.proc.pid, resource.RLIMIT_DATA, (limit, limit))
        except OSError as exc:  # it ended already: its ``ready`` says so
            log.warning("secret proxy's memory limit not set", extra={
                "sandbox_id": proxy.sandbox_id, "error": type(exc).__name__})
        hierarchy, why = Hierarchy.detect(self.ctx.settings.vmm_cgroups)
        if hierarchy is not None:  # tried as whoever this is: root, or a delegated user
            try:
                group = hierarchy.create(f"secret-proxy-{proxy.sandbox_id}",
                                         Limits(limit, 1.0, 256))
                for d in group.dirs:
                    (d / "cgroup.procs").write_text(str(proxy.proc.pid))
                proxy.cgroup = group
                return
            except OSError as exc:
                why = str(exc)
        if _CGROUP_NOTE is None:
            _CGROUP_NOTE = why
            log.info("secret proxies run without a memory cgroup", extra={
                "reason": why, "rlimit_data_mib": limit >> 20})
