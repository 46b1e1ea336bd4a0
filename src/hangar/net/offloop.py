"""pyroute2's synchronous API off the event loop (``off_loop``), and the host's addresses.

pyroute2 (0.9) drives an event loop of its own in its synchronous ``IPRoute`` and fails
inside a running one ("This event loop is already running"); ``off_loop`` runs such a
function in a worker thread when it is called from a thread with a running loop (which
it then blocks for the call's tens of milliseconds).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def off_loop(fn: F) -> F:
    """``fn``, run in a worker thread when called from a thread running an event loop."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return fn(*args, **kwargs)
        with ThreadPoolExecutor(1, thread_name_prefix="hangar-net") as pool:
            return pool.submit(fn, *args, **kwargs).result()
    return wrapper  # type: ignore[return-value]


@off_loop
def host_ipv4() -> list[str]:
    """The host's own IPv4 addresses (every interface's, from the kernel). Raises the
    errors of pyroute2 (no netlink)."""
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        return [str(a.get_attr("IFA_ADDRESS")) for a in ipr.get_addr(family=2)
                if a.get_attr("IFA_ADDRESS")]
