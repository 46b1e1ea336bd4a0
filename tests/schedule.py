"""pytest plugin: how the suite spreads over parallel workers (registered by conftest.py).

``scripts/test.sh`` runs the suite on ``HANGAR_TEST_WORKERS`` pytest-xdist workers (default
3): each worker is its own pytest session with its own server (conftest's session
fixtures), and a *group* of tests always runs whole on one worker. This plugin makes the
groups (a scheduler of its own, ``GroupScheduling``) and their order:

* a module is its own group, so its module-scoped servers and sandboxes are made once;
* modules that share state outside their own data directory run as one group, one after
  another (``HOST_GROUP``): the fixed network namespace names of their labs, or the shared
  image cache's build folder and names that they rebuild or inspect;
* groups are queued longest first (the workers collect, and sort, the tests) (``COST_S``: seconds each module took in a whole run on
  this kind of machine, 2 cores, TCG), so the long ones do not start last and leave a
  worker idle at the end. A module missing from the table counts as ``DEFAULT_COST_S``;
* ``scripts/test.sh`` starts the tests while the images other than base are still being
  built (``scripts/install.sh --base-first``, which holds ``LATER_LOCK`` meanwhile), and a
  module that needs one of them, or builds into the image cache (``needs_later_images``),
  waits for them first (conftest's ``later_images``). So while they build, a worker that
  asks for work gets the first queued group with a module that need not wait
  (``waits``), and within a group (``HOST_GROUP``) the modules that wait come last.

Without workers (``-n 0`` or no xdist) nothing changes: tests run in file order.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import pytest

HOST_GROUP = "host-state"
"""The group of the modules that share state outside their own data directory."""

SHARED_STATE: tuple[str, ...] = (
    # builds into the shared image cache (template builds, its build/ folder checked empty)
    "test_images", "test_image_pinning", "test_image_hostile", "test_templates",
    "test_booted_templates",
)
"""Modules of ``HOST_GROUP`` by name; ``uses_host_state`` finds the others by their imports."""

LAB_IMPORTS = ("netns", "egress_lab", "test_network")
"""Helpers whose labs have fixed ``ip netns`` names (hg-host, hg-inet, hg-eg-*, ...): a
module that imports one joins ``HOST_GROUP``."""

TESTS = Path(__file__).resolve().parent

LATER_IMAGES: frozenset[str] = frozenset({
    "test_code_interpreter", "test_desktop", "test_docs", "test_e2b_api", "test_e2b_domain",
    "test_e2b_registry", "test_ops_tls", "test_terminal", "test_tools_browser", "test_tools_vm",
})
"""Modules that use an image other than base (desktop, dev, code-interpreter), look at
whether one is built (test_e2b_api), run ``hangar image gc`` on the image cache, which
waits for every recipe's build lock (test_e2b_registry), or run the docs' examples
(test_docs)."""


COST_S: dict[str, int] = {
    "test_code_interpreter": 240,
    "test_docs": 248,
    "test_ops_deploy": 212,
    "test_tools_browser": 110,
    "test_booted_templates": 162,
    "test_cluster": 143,
    "test_recovery": 109,
    "test_network": 101,
    "test_machines": 99,
    "test_image_pinning": 95,
    "test_e2b_envd": 91,
    "test_e2b_domain": 90,  # measured alone at load 16: 250 s (about a third of that quiet)
    "test_guest_metadata_bounds": 40,
    "test_template_memory": 91,
    "test_desktop": 90,
    "test_guest_limits": 89,
    "test_secrets": 69,
    "test_guest_bounds": 65,
    "test_tools_vm": 62,
    "test_exec": 55,
    "test_templates": 54,
    "test_processes": 53,
    "test_ops_host": 49,
    "test_ops_tls": 45,
    "test_root_acts": 45,  # measured alone, 2026-12-04 (114 s at load 15)
    "test_tools": 44,
    "test_terminal": 39,
    "test_confinement": 35,
    "test_volumes": 35,
    "test_hostile": 33,
    "test_sdk_package": 33,
    "test_egress": 33,
    "test_front_door": 31,
    "test_log_levels": 29,
    "test_privsep": 28,
    "test_client_data": 28,
    "test_auth": 27,
    "test_agent_client": 26,
    "test_ports": 25,
    "test_images": 25,
    "test_qemu_snapshot": 24,
    "test_cli": 23,
    "test_e2b_api": 23,
    "test_e2b_builds": 60,
    "test_e2b_registry": 45,  # measured alone, 2026-12-05 (44 s)
    "test_teams": 30,  # measured alone, 2026-12-05 (30 s)
    "test_sdk_template_build": 45,  # measured alone, 2026-12-05 (41 s)
    "test_teams_keys": 35,  # measured alone, 2026-12-05 (32 s)
    "test_reconcile": 21,
    "test_races": 20,
    "test_api": 19,
    "test_ops_backup": 17,
    "test_boot_stall": 15,
    "test_sdk_retries": 15,
    "test_firecracker": 13,
    "test_port_caps": 13,
    "test_sdk_events": 12,
    "test_density": 11,
    "test_vnc_bounds": 10,
    "test_image_hostile": 10,
    "test_limits": 9,
    "test_sdk_surface": 9,
    "test_overlay_root": 8,
    "test_disk_full": 8,
    "test_vmm_uids": 7,
    "test_processes_agent": 7,
    "test_cluster_parts": 6,
    "test_events": 6,
    "test_guest_ops": 4,
    "test_layers": 4,
    "test_dashboard_storage": 4,
    "test_jailer_option": 3,
    "test_files": 2,
    "test_bounds": 1,
    "test_lifecycle_verbs": 1,
    "test_lifecycle": 1,
    "test_openapi": 0,
    "test_tasks": 0,
    "test_envd_codec": 0,
    "test_file_sizes": 0,
    "test_ops_metrics": 0,
    "test_vmm_files": 0,
    "test_log_guard": 0,
    "test_durable": 0,
}
"""Seconds per module in one whole run (setup, call and teardown summed), 2026-12-03."""

DEFAULT_COST_S = 10


@functools.cache
def uses_host_state(module: str) -> bool:
    """Whether the test module ``module`` (its name without ``.py``) shares host state."""
    if module in SHARED_STATE:
        return True
    try:
        source = (TESTS / f"{module}.py").read_text()
    except OSError:
        return False
    return any(f"from {lab} import" in source or f"import {lab}\n" in source
               for lab in LAB_IMPORTS)


def needs_later_images(module: str) -> bool:
    """Whether the test module ``module`` must wait for the images built after base: it
    uses one, or builds into the image cache (``SHARED_STATE``)."""
    return module in LATER_IMAGES or module in SHARED_STATE


LATER_LOCK = Path(os.environ.get("HANGAR_DATA_DIR", "/var/lib/hangar")) / "images-later.lock"
"""Held (exclusive) by ``scripts/install.sh --base-first`` while it builds the images other
than base in the background."""


def images_building() -> bool:
    """Whether ``scripts/install.sh --base-first`` is still building the images other than
    base (someone holds ``LATER_LOCK``)."""
    import fcntl

    try:
        with open(LATER_LOCK, "rb") as f:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


def waits(group: str) -> bool:
    """Whether every module of ``group`` waits for the images built after base: a group of
    one module is named after it; ``HOST_GROUP`` names no module, and has some that need
    not wait."""
    return needs_later_images(group)


def group_of(module: str) -> str:
    """The xdist group of a test module (its name without ``.py``)."""
    return HOST_GROUP if uses_host_state(module) else module


def group_of_nodeid(nodeid: str) -> str:
    """The group of the test ``nodeid`` (``tests/test_x.py::test_y[...]``)."""
    return group_of(Path(nodeid.split("::", 1)[0]).stem)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scope scheduling with ``group_of`` as the scope: each group goes whole to one
    worker, in the order the workers collected them (``--no-loadscope-reorder``)."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of_nodeid(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            # xdist gives a worker its next group when it has at most 2 tests left
            if images_building():
                ready = next((g for g in self.workqueue if not waits(g)), None)
                if ready is not None:
                    self.workqueue.move_to_end(ready, last=False)
            super()._assign_work_unit(node)

    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On a worker: the tests sorted by group, the costliest group first; in a group, the
    modules that need not wait for the images built after base first, each module's tests
    in file order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    cost: dict[str, int] = {}
    for module in {Path(str(item.fspath)).stem for item in items}:
        group = group_of(module)
        cost[group] = cost.get(group, 0) + COST_S.get(module, DEFAULT_COST_S)
    place = {id(item): n for n, item in enumerate(items)}

    def key(item: pytest.Item) -> tuple[int, str, bool, int]:
        module = Path(str(item.fspath)).stem
        return -cost[group_of(module)], group_of(module), needs_later_images(module), \
            place[id(item)]

    items.sort(key=key)


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    """On a worker, with ``HANGAR_TEST_TIMELINE`` set (a file's path), a line per test as it
    ends: the wall clock, the worker and the test's id, appended; shows how a run's groups
    fell on its workers (which one ran last, and alone)."""
    path = os.environ.get("HANGAR_TEST_TIMELINE")
    if path and os.environ.get("PYTEST_XDIST_WORKER"):
        import time

        with open(path, "a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} "
                    f"{os.environ['PYTEST_XDIST_WORKER']} {nodeid}\n")
