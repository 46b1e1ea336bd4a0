"""Server settings, read from ``HANGAR_*`` environment variables.

Every figure carries its unit in its name or docstring. Defaults suit a
single host; ``hangar serve`` flags override them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from hangar.layout import DEFAULT_ROOT
from hangar.schemas.bounds import (
    DISK_MIB_MAX, DISK_MIB_MIN, MEMORY_MIB_MAX, MEMORY_MIB_MIN, TTL_MAX_S, VCPUS_MAX, VCPUS_MIN,
)


class Settings(BaseSettings):
    """Settings of one Hangar server process."""

    model_config = SettingsConfigDict(env_prefix="HANGAR_", extra="ignore")

    data_dir: Path = Field(DEFAULT_ROOT, description="Root of the on-disk layout.")
    host: str = Field("127.0.0.1", description="Address the REST API listens on.")
    port: int = Field(8080, description="TCP port of the REST API.")
    uds: Path | None = Field(None, description="Serve on this Unix socket instead of TCP.")
    forwarded_allow_ips: str = Field(
        "127.0.0.1", description="Comma-separated addresses (or *) whose X-Forwarded-For and "
                                 "X-Forwarded-Proto are trusted: the reverse proxy's.")
    domain: str | None = Field(
        None, description="Domain under which exposed ports are also reachable by host name, "
                          "http(s)://<port>-<sandbox id>.<domain>/ (a wildcard DNS name that "
                          "points at this server or its reverse proxy); may end in :port. "
                          "Unset: ports are reached by path only, /sandboxes/<id>/ports/<port>/.",
        pattern=r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?(:[0-9]{1,5})?$")
    port_path_sandbox: bool = Field(
        True, description="Answers of ports reached by path (/sandboxes/<id>/ports/<port>/, "
                          "on this server's own origin) get Content-Security-Policy: sandbox "
                          "(an opaque origin: no cookies, storage or service workers of "
                          "Hangar's origin, no scripting of the dashboard). 0 turns it off "
                          "for apps that need their origin; prefer HANGAR_DOMAIN's "
                          "host-routed URLs for those (docs/security.md, class 5).")
    port_token_ttl_s: float = Field(
        3600.0, gt=0, le=TTL_MAX_S,
        description="Lifetime of a private port's signed URL when the caller names none, "
                    "seconds.")
    engine: Literal["auto", "firecracker", "qemu"] = Field(
        "auto", description="VMM: auto takes Firecracker when its probe boot works, else QEMU.")
    firecracker_jailer: Literal["auto", "on", "off"] = Field(
        "auto", description="Run Firecracker VMMs under its jailer: auto when Hangar is root "
                            "and the jailer is found; on requires it.")
    privsep: bool | None = Field(
        None, description="Started as root, fork a small privileged helper and run the "
                          "HTTP server as HANGAR_USER (docs/security.md, class 9); the "
                          "helper also runs Firecracker's jailer. Unset or 1: on; 0 "
                          "turns it off. "
                          "A start as another user than root runs as that user.")
    user: str = Field("hangar", max_length=32,
                      description="The unprivileged user of the server under the split.")
    vmm_confine: bool = Field(
        True, description="Confine QEMU VMMs (own uid, cgroup, mount namespace, seccomp); "
                          "see hangar.engines.confine and docs/security.md.")
    vmm_cgroups: Literal["auto", "v2", "v1", "off"] = Field(
        "auto", description="cgroup version for VMM limits; auto prefers v2.")
    vmm_memory_overhead_mib: int = Field(
        192, ge=32, description="Memory a VMM's cgroup allows beyond its guest's, MiB "
                                "(plus the TCG translation cache under TCG).")
    console_log_bytes: int = Field(
        4 << 20, ge=0, description="Most bytes of console log kept per sandbox, rotated "
                                   "(needs multilog; 0: no cap).")
    max_execs_per_sandbox: int = Field(
        16, ge=1, description="Commands running at once in one sandbox (429 beyond).")
    port_max_connections: int = Field(
        64, ge=1, description="Connections open at once to one exposed port, through the "
                              "port proxy and envd's port forwarding (429 beyond).")
    sandbox_max_port_connections: int = Field(
        256, ge=1, description="Connections open at once to all of one sandbox's ports "
                               "(429 beyond).")
    port_websocket_buffer_mib: int = Field(
        64, ge=1, description="MiB of guest WebSocket messages the port proxy holds at once "
                              "for one sandbox's clients (assembled or not yet read); a "
                              "connection that needs more waits 10 s, then is closed with "
                              "1013.")
    port_websocket_buffer_total_mib: int = Field(
        512, ge=1, description="MiB of guest WebSocket messages the port proxy holds at once "
                               "for all sandboxes.")
    envd_max_requests_per_sandbox: int = Field(
        128, ge=1, description="Requests of E2B's data plane (envd calls, streams, file "
                               "transfers) in flight at once for one sandbox (429, or "
                               "Connect's resource_exhausted, beyond).")
    envd_max_watchers_per_sandbox: int = Field(
        16, ge=1, description="Polled file watchers of E2B's data plane live at once in one "
                              "sandbox (resource_exhausted beyond).")
    egress_max_flows_per_sandbox: int = Field(
        64, ge=1, description="DNS queries, DNS TCP connections and egress-proxy connections "
                              "one guest under domain rules has open at once (the rest are "
                              "dropped or closed).")
    memory_budget_mib: int | None = Field(
        None, ge=MEMORY_MIB_MIN, description="Sum of guest memory of running VMMs, MiB (429 beyond); "
                                  "unset: 80 % of the host's RAM.")
    memory_overcommit: float = Field(
        1.0, ge=1.0, le=16.0, description="Guests may declare this many times the memory "
                                         "budget together (idle guests use a fraction of "
                                         "theirs; the headroom keeps the host safe: "
                                         "hangar.core.memory).")
    memory_headroom_mib: int | None = Field(
        None, ge=0, description="Host memory (MemAvailable, MiB) kept free: below it idle "
                                "sandboxes are put to sleep, then starts are refused (429). "
                                "Unset: 5 % of the host's RAM.")
    memory_pressure_idle_s: float = Field(
        60.0, ge=0, description="Seconds without a call before a sandbox may be put to sleep "
                                "to relieve the host's memory.")
    max_disk_mib: int = Field(
        65536, ge=DISK_MIB_MIN, description="Largest disk one sandbox may ask for, MiB (400 beyond).")
    snapshot_storage_bytes: int | None = Field(
        None, ge=0, description="Most bytes all snapshots may hold on disk (429 beyond); "
                                "unset: half the data directory's file system.")
    accel: Literal["auto", "kvm", "tcg"] = Field(
        "auto", description="QEMU accelerator; auto runs a probe boot to decide."
    )
    tcg_tb_mib: int = Field(
        256, ge=8, le=4096, description="QEMU under TCG: translation buffer per VM, MiB (QEMU's "
                                       "own default is 1024); see docs/performance.md.")
    balloon: bool = Field(
        True, description="QEMU guests get a virtio-balloon with free page reporting (memory a "
                          "guest frees goes back to the host) and memory statistics.")
    ksm: bool = Field(
        False, description="Let the host's KSM merge identical pages across QEMU guests. Off by "
                           "default: merged pages open a timing side channel between sandboxes "
                           "(docs/security.md). The host's ksmd must run (/sys/kernel/mm/ksm/run).")
    guest_aslr: Literal["auto", "on", "off"] = Field(
        "auto", description="QEMU guests' address-space randomization: auto is off under TCG "
                            "(a process's libraries are translated again at each new address: "
                            "a spawn costs 4 times as much) and on under KVM; see "
                            "docs/security.md.")
    default_image: str = Field("base", description="Template used when a create names none.")
    default_vcpus: int = Field(1, ge=VCPUS_MIN, le=VCPUS_MAX)
    default_memory_mib: int = Field(512, ge=MEMORY_MIB_MIN, le=MEMORY_MIB_MAX)
    default_disk_mib: int = Field(2048, ge=DISK_MIB_MIN, le=DISK_MIB_MAX)
    boot_timeout_s: float | None = Field(
        None, gt=0, description="Seconds to wait for a booting guest's agent (its VMM alive). "
                                "Unset: 60 with hardware acceleration, 180 under emulation "
                                "(TCG), where a guest boots several times slower and more so "
                                "on a busy host (boot_deadline_s).")
    max_sandboxes: int = Field(30, ge=1, description="Cap on concurrently running VMs.")
    max_concurrent_starts: int | None = Field(
        None, ge=1, le=1024, description="VMM starts (boots, snapshot restores, wakes) in "
                                         "progress at once; more wait in the start queue "
                                         "(hangar.core.starts). Unset: max(2, cores).")
    start_queue: int = Field(
        256, ge=0, le=100_000, description="Starts that may wait for a slot at once; one "
                                           "more is refused at once (429 start_queue_full).")
    start_queue_wait_s: float = Field(
        90.0, gt=0, le=3600, description="Seconds a start may wait in the queue (429 "
                                         "start_queue_wait beyond); under the SDK's 120 s "
                                         "for a create, so a waiter hears why.")
    build_templates_max: int = Field(
        200, ge=1, description="Cap on the templates built through E2B's API the server "
                               "holds (hangar.core.builds); a new one past it is a 429.")
    registries: str = Field(
        "docker.io", max_length=4096,
        description="Registries (hosts, comma-separated; * for any) that templates built "
                    "through E2B's API may pull images from (hangar.images.registry).")
    registry_mirrors: str = Field(
        "", max_length=4096,
        description="registry=host[:port] pairs, comma-separated: pull that registry's "
                    "images from the mirror instead.")
    registry_insecure: str = Field(
        "", max_length=4096,
        description="Registry hosts reached over plain HTTP or unverified TLS "
                    "(comma-separated).")
    registry_auth: Path | None = Field(
        None, description="A containers-auth.json file with the operator's registry "
                          "credentials, read by root only.")
    volumes_max_total_mib: int = Field(
        1 << 20, ge=16, description="Cap on the sizes of all named volumes together, MiB "
                                    "(default 1 TiB); their images are sparse, so this bounds "
                                    "what they may come to hold on the host.")
    default_timeout_s: float = Field(
        3600.0, ge=0, description="Time to live of a sandbox created without one, seconds; "
                                  "0 keeps such sandboxes until deleted.")
    pool_size: int = Field(2, ge=0, le=64,
                           description="Paused VMs of the default template kept ready.")
    pool_templates: str | None = Field(
        None, description="Warm pool by template, e.g. 'base=2,dev=1' (paused VMs of each, "
                          "default shape); unset: pool_size VMs of default_image.")
    template_snapshots: bool = Field(
        True, description="Creates restore their image's booted template snapshot "
                          "(hangar.core.templates); off: every create boots cold.")
    pool_max_age_s: float = Field(900.0, gt=0, description="Pool VMs older than this are replaced.")
    reconcile_concurrency: int = Field(
        4, ge=1, le=64, description="Slow reconcile steps (sleep, wake, restore) run at once.")
    purge_retention_s: float = Field(
        7 * 86400.0, gt=0, le=365 * 86400,
        description="Records of deleted and expired sandboxes are kept this long, then "
                    "purged (seconds; until then GET answers 404 or 410 for them).")
    machine_idle_s: float = Field(1800.0, gt=0,
                                  description="Idle seconds before a user's machine sleeps.")
    network: Literal["auto", "tap", "user", "off"] = Field(
        "auto", description="Guest networking: auto takes TAP devices when run as root, "
                            "else QEMU's user-mode stack; off gives guests no NIC.")
    net_pool: str = Field("172.30.0.0/16", description="Guest address pool (CIDR).")
    net_bridge: str = Field("hgbr0", description="Bridge the TAP devices join.")
    net_user_open: bool = Field(
        False, description="Allow egress 'open' under QEMU user-mode networking (used where "
                           "TAP devices are not available). There a guest reaches the host's "
                           "loopback services through 10.0.2.2, so this is off unless the "
                           "operator turns it on.")
    net_dns: str | None = Field(None, description="Resolver given to guests; default: the "
                                                  "host's first non-loopback nameserver.")
    api_key: str | None = Field(
        None, description="The default API key; when unset, read from or generated into "
                          "data_dir/api-key. Named keys live in data_dir/api-keys.")
    secrets_key_file: Path | None = Field(
        None, description="The vault's key (32 bytes, 0600; made on first start): secrets are "
                          "stored sealed with it (hangar.core.secrets). Default: "
                          "/etc/hangar/secrets.key as root, else "
                          "~/.config/hangar/secrets.key: outside the data directory, so "
                          "neither a copy of it nor `hangar backup` holds the key.")
    secret_proxy_mitmdump: Path | None = Field(
        None, description="The mitmdump of the secret proxy's own environment; default: "
                          ".venv-proxy/bin/mitmdump beside the server's (scripts/install.sh).")
    secret_proxy_upstream_ca: Path | None = Field(
        None, description="A PEM file of the CAs the secret proxy trusts upstream instead "
                          "of the public ones (internal APIs under a private CA; the "
                          "tests' stand-in internet).")
    secret_proxy_max_body_bytes: int = Field(
        4 << 30, ge=1 << 20, description="Largest request or answer body a secret proxy "
                                         "passes when its length is declared (413 or 502 "
                                         "beyond); bodies stream through, never held.")
    secret_proxy_memory_mib: int = Field(
        512, ge=64, description="Memory of one secret proxy, MiB: its RLIMIT_DATA, and its "
                                 "memory cgroup's limit when the server may make cgroups "
                                 "(root, or cgroup delegation).")
    secret_proxy_max_connections: int = Field(
        128, ge=1, description="Connections one sandbox's secret proxy serves at once (the "
                               "rest wait in its listen queue).")
    max_json_bytes: int = Field(
        8 << 20, ge=1024, description="Largest JSON request body, bytes (413 beyond); file "
                                      "uploads are streamed and not bound by it.")
    etcd: str | None = Field(
        None, description="Comma-separated URLs of the cluster's etcd members "
                          "(https://host:2379,...); set, this server is a node of a cluster "
                          "(docs/cluster.md, `hangar node join`); unset, a single host.")
    etcd_pki: Path | None = Field(
        None, description="Folder with this node's etcd client files (ca.crt, node.crt, "
                          "node.key; `hangar cluster certs`); default: data_dir/etcd-pki.")
    node_name: str | None = Field(None, description="This node's name in the cluster; "
                                                    "default: the host name.")
    advertise: str | None = Field(None, description="host:port other nodes reach this "
                                                    "node's API at; default: host:port.")
    log_level: str = Field("INFO")

    def boot_deadline_s(self, accel: str) -> float:
        """Seconds to wait for a booting guest's agent on an engine of accelerator ``accel``
        (``"kvm"``, ``"tcg"``, ...): ``boot_timeout_s`` when set, else 60, or 180 under
        emulation (TCG). Measured on a 2-core emulated host at load 8: a desktop guest's
        agent started 33 s into its boot and had not answered 60 s after the VMM started."""
        if self.boot_timeout_s is not None:
            return self.boot_timeout_s
        return 180.0 if accel == "tcg" else 60.0
