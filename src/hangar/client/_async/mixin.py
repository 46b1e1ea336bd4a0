"""What the flat client's mixins (``machines``, ``desktop``, ``code``, ``processes``,
``volumes``, ``secrets``, ``files``, ``snapshots``, ``ports``, ``terminals``, ``events``,
``templates``, ``teams``) share. Source of ``hangar/client/_sync/mixin.py``."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from hangar.client._async.client import AsyncHangar


def flat_client(obj: object) -> AsyncHangar:
    """The flat client a mixin method runs on (a mixin is only ever part of
    ``AsyncHangar``)."""
    return cast("AsyncHangar", obj)
