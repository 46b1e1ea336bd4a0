"""What this host offers: ``hangar doctor`` (KVM, VMMs, network, the host checklist) and
``hangar bench boot`` (guest boots timed straight on the engine). ``hangar.cli.main``
registers ``doctor``."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from hangar.cli.common import DataDir, fail, out, server_settings
from hangar.errors import HangarError
from hangar.schemas.bounds import MEMORY_MIB_MAX, MEMORY_MIB_MIN


bench_app = typer.Typer(help="Measure this host: boots and their phases.", no_args_is_help=True)


def doctor(data_dir: DataDir = None) -> None:
    """Say what this host offers (KVM, VMMs and their versions) and which engine auto picks."""
    from hangar.engines.doctor import diagnose
    from hangar.images import resolve_image
    from hangar.layout import Layout
    from hangar.net import doctor_lines

    settings = server_settings(data_dir)
    layout = Layout(settings.data_dir)
    try:
        image = resolve_image(layout, "base")
    except HangarError:
        image = None
    from hangar.engines.confine import config_from

    for line in diagnose(layout, image, confine=config_from(settings),
                         jailer_mode=settings.firecracker_jailer).lines():
        print(line)
    for line in doctor_lines(settings.network, user_open=settings.net_user_open,
                             bridge=settings.net_bridge, pool=settings.net_pool):
        print(line)
    from hangar.ops.checklist import host_checklist, lines

    from hangar.core.secret_proxy import default_mitmdump

    for line in lines(host_checklist(data_dir=layout.root, image=settings.default_image,
                                     bridge=settings.net_bridge, host=settings.host,
                                     port=settings.port,
                                     mitmdump=settings.secret_proxy_mitmdump
                                     or default_mitmdump())):
        print(line)


@bench_app.command("boot")
def bench_boot(
    runs: Annotated[int, typer.Option(min=1, max=50, help="Boots, one after the other.")] = 3,
    image: Annotated[Optional[str], typer.Option(help="Image (default: the server's).")] = None,
    memory_mib: Annotated[int, typer.Option(min=MEMORY_MIB_MIN, max=MEMORY_MIB_MAX,
                                             help="Guest memory, MiB.")] = 512,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    data_dir: DataDir = None,
) -> None:
    """Boot guests straight on the engine (no server) and print each boot's phases.

    The phases are those every boot logs (vmm, kernel, initramfs, init, agent;
    seconds), plus the time to the first command's result.
    """
    import asyncio
    import json as json_

    from hangar.engines.bootbench import bench_boot as run_bench
    from hangar.engines.confine import config_from as confine_config
    from hangar.engines.doctor import choose_engine
    from hangar.engines.qemu import tuning_from
    from hangar.images import resolve_image
    from hangar.layout import Layout

    settings = server_settings(data_dir)
    layout = Layout(settings.data_dir)
    try:
        img = resolve_image(layout, image or settings.default_image)
        engine = choose_engine(settings.engine, layout, img, accel=settings.accel,
                               jailer=settings.firecracker_jailer,
                               confine=confine_config(settings),
                               tuning=tuning_from(settings))
        report = asyncio.run(run_bench(engine, img, runs, memory_mib))
    except HangarError as exc:
        fail(exc)
    if as_json:
        print(json_.dumps(report, indent=2))
        return
    from rich.table import Table

    eng = report["engine"]
    table = Table(title=f"{runs} boots of {report['image']}, {memory_mib} MiB, "
                        f"{eng['engine']} ({eng['accel']}); seconds")
    cols = list(report["median"])
    table.add_column("run")
    for c in cols:
        table.add_column(c, justify="right")
    for n, r in enumerate(report["runs"], 1):
        table.add_row(str(n), *(f"{r.get(c, 0):.2f}" for c in cols))
    table.add_row("median", *(f"{report['median'][c]:.2f}" for c in cols), style="bold")
    out.print(table)
