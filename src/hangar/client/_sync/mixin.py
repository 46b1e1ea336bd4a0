# Generated from hangar/client/_async/mixin.py by scripts/gen_sync.py: do not edit.
"""What the flat client's mixins (``machines``, ``desktop``, ``code``, ``processes``,
``volumes``, ``secrets``, ``files``, ``snapshots``, ``ports``, ``terminals``, ``events``,
``templates``, ``teams``) share. Source of ``hangar/client/_sync/mixin.py``."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from hangar.client._sync.client import Hangar


def flat_client(obj: object) -> Hangar:
    """The flat client a mixin method runs on (a mixin is only ever part of
    ``AsyncHangar``)."""
    return cast("Hangar", obj)
