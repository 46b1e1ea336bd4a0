"""The registry of templates built here (``hangar.core.builds``), and who sees which.

``Registry`` keeps ``<data>/builds/templates.json`` (its layout: ``hangar.core.builds``)
by **stored** name: a template's own name for the operator's, ``TEAM/name`` for a
team's (``hangar.core.teams.scoped``). Its public methods take a name as the acting
team gives it (``_named``): a team's own template first, then the operator's, which
every team may see and start sandboxes from but not change (``not_yours``: Forbidden);
another team's is missing (NotFound, worded as for a missing one).
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from hangar.core.build_uploads import Uploads
from hangar.core.acting import acting
from hangar.core.teams import owner_of, scoped, unscoped
from hangar.durable import atomic_write
from hangar.errors import Forbidden, InvalidRequest, NotFound

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
"""A built template's name (a snapshot name too: ``hangar.core.snapshots.check_name``)."""
TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
DEFAULT_TAG = "default"
TAGS_MAX = 100
"""Tags a template may have (every tag is a name a create may use)."""


class Registry(Uploads):
    """The template records of ``Builds`` (set up by its ``__init__``)."""

    _file: Any
    _data: dict[str, Any] | None

    def _load(self) -> dict[str, Any]:
        if self._data is None:
            try:
                data = json.loads(self._file.read_bytes())
            except FileNotFoundError:
                data = {"templates": {}}
            for t in data["templates"].values():  # a build the server stopped during
                for b in t["builds"].values():
                    if b["status"] in ("waiting", "building"):
                        b.update(status="error", reason="the server restarted during the "
                                 "build", step="base", finished_at=time.time())
            self._data = data
        return self._data

    def _save(self) -> None:
        self.root.mkdir(mode=0o700, exist_ok=True)
        atomic_write(self._file, json.dumps(self._load(), indent=1, sort_keys=True).encode())

    def _template(self, name: str) -> dict[str, Any]:
        t = self._load()["templates"].get(name)
        if t is None:
            raise NotFound(f"template {unscoped(name)!r} was not built here",
                           template=unscoped(name))
        return t

    def _build(self, name: str, build_id: str) -> dict[str, Any]:
        b = self._template(name)["builds"].get(build_id)
        if b is None:
            raise NotFound(f"template {unscoped(name)!r} has no build {build_id!r}",
                           template=unscoped(name), build=build_id)
        return b

    def _named(self, name: str, change: bool = False) -> str:
        """The stored name of template ``name`` as the acting team gives it: its own,
        else (unless ``change``) the operator's. Raises NotFound (none, or another
        team's), Forbidden (``change`` of the operator's by a team)."""
        templates = self._load()["templates"]
        if scoped(name) in templates:
            return scoped(name)
        if acting() is not None and owner_of(name) is None and name in templates:
            if not change:
                return name
            raise not_yours(name)
        raise NotFound(f"template {name!r} was not built here", template=name)

    def shared(self, name: str) -> bool:
        """Whether ``name`` is the operator's template seen by a team (E2B's public)."""
        return acting() is not None and self._named(name) == name

    @staticmethod
    def check_name(name: str) -> None:
        """Raise InvalidRequest unless ``name`` is a template name (``NAME_RE``)."""
        if not NAME_RE.fullmatch(name):
            raise InvalidRequest(f"name: {name[:80]!r} is not a template name (1 to 63 of "
                                 "a-z, 0-9, '.', '_' and '-', a letter or digit first)",
                                 field="name")

    @staticmethod
    def check_tags(tags: list[str], have: Any = ()) -> None:
        """Raise InvalidRequest for a malformed tag, or past ``TAGS_MAX`` with ``have``."""
        for tag in tags:
            if not TAG_RE.fullmatch(tag):
                raise InvalidRequest(f"tags: {tag[:80]!r} is not a tag (1 to 128 letters, "
                                     "digits, '.', '_' and '-')", field="tags")
        if len(set(have) | set(tags)) > TAGS_MAX:
            raise InvalidRequest(f"tags: a template has at most {TAGS_MAX} tags", field="tags")

    def names(self) -> list[str]:
        """Every template built here the acting team sees (a build of it ready or not),
        by the names it gives them, sorted: a team's own, then the operator's."""
        stored = self._load()["templates"]
        who = acting()
        if who is None:
            return sorted(stored)
        own = {unscoped(n) for n in stored if owner_of(n) == who}
        return sorted(own | {n for n in stored if owner_of(n) is None})

    def held_by(self, team: str) -> int:
        """How many templates team ``team`` built here (stored as ``TEAM/name``)."""
        return sum(1 for n in self._load()["templates"] if owner_of(n) == team)

    def exists(self, name: str) -> bool:
        """Whether the acting team sees a template ``name`` (``names``)."""
        try:
            self._named(name)
        except NotFound:
            return False
        return True


def bare(stored: str) -> str:
    """A stored template name without its team (``hangar.core.teams.scoped``)."""
    return stored.rpartition("/")[2]


def not_yours(name: str) -> Forbidden:
    """A team's change of the operator's template ``name``: refused, naming why."""
    return Forbidden(f"template {name!r} is the operator's: a team may start sandboxes from "
                     "it but not build, tag or remove it", template=name)
