"""``hangar status``: the server's health, its engine and its warm pool, in two or three lines."""

from __future__ import annotations

from hangar.cli.common import out, sdk


def status() -> None:
    """The server's health and its warm pool."""
    with sdk() as h:
        health = h.health()
        pool = h.pool()
    engine, details = describe_engine(health.engine)
    noun = "sandbox" if health.sandboxes == 1 else "sandboxes"
    out.print(f"Hangar {health.version} at {h.base_url}: {health.status}; {health.sandboxes} "
              f"{noun}; engine {engine}", highlight=False, soft_wrap=True)
    if details:
        out.print(f"  {details}", highlight=False, soft_wrap=True)
    out.print(f"warm pool ({pool.image}): {pool.ready} ready, {pool.starting} starting, "
              f"{pool.size} wanted, replaced after {pool.max_age_s:.0f} s")


def describe_engine(engine: dict[str, str]) -> tuple[str, str]:
    """``("qemu 7.2.22 (tcg)", "tb_mib=48, balloon=true, ...")`` from /health's ``engine``
    map: the engine named once with its version and accelerator, then its other facts."""
    name, accel = engine.get("engine", "?"), engine.get("accel", "")
    # "QEMU emulator version 7.2.22 (Debian ...)" says the name again: keep the number.
    version = next((w for w in engine.get("version", "").split() if w[:1].isdigit()),
                   engine.get("version", ""))
    head = " ".join(x for x in (name, version) if x) + (f" ({accel})" if accel else "")
    rest = ", ".join(f"{k}={v}" for k, v in engine.items()
                     if k not in ("engine", "version", "accel") and v)
    return head, rest
