"""The uploads of template builds: the archives a ``COPY`` places, by E2B's files hash.

``Uploads`` is the part of ``hangar.core.builds.Builds`` that keeps them, in
``<data>/builds/files/<name>/<sha256>`` (a team's template: ``<team>+<name>``,
``_folder``): signed upload links (an HMAC of the server's port key over the
template's stored name, which a team's token carries its team for;
``UPLOAD_TTL_S``), the streamed upload (``UPLOAD_MAX``),
and the check of an archive against its hash before a build places it
(``hangar.build_archive.archive_hash``, bounded). Errors: InvalidRequest (not
a SHA-256 in hex), NotFound (no such template or upload), TooLarge.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import re
import tarfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hangar.build_archive import archive_hashes
from hangar.core.build_steps import Copy, StepFailed
from hangar.core.teams import SCOPE_SEP, owner_of, scoped
from hangar.errors import InvalidRequest, NotFound, TooLarge
from hangar.teams import NAME as TEAM_NAME

if TYPE_CHECKING:
    from hangar.core.sandboxes import SandboxManager

HASH_RE = re.compile(r"^[0-9a-f]{64}$")
UPLOAD_MAX = 1 << 30
"""Largest uploaded archive, bytes (compressed as sent)."""
UPLOAD_TTL_S = 3600
"""Seconds an upload link stays valid."""


class Uploads:
    """Uploaded archives of the templates built here (``Builds`` is one)."""

    m: SandboxManager
    root: Path

    def _template(self, name: str) -> dict[str, Any]:
        raise NotImplementedError

    def _named(self, name: str, change: bool = False) -> str:
        raise NotImplementedError

    def _folder(self, stored: str) -> Path:
        """Where the uploads of the template stored as ``stored`` are kept (a team's:
        ``<team>+<name>``; ``+`` is in no team's nor template's name)."""
        return self.root / "files" / stored.replace(SCOPE_SEP, "+")

    def _archive(self, name: str, digest: str) -> Path:
        """Where archive ``digest`` of ``name`` is kept; raises InvalidRequest unless
        ``digest`` is a SHA-256 in hex (a step's ``filesHash`` comes from a client: it
        must never name another file, which a failed check removes)."""
        self._check_hash(digest)
        return self._folder(name) / digest

    def _check_hash(self, digest: str) -> None:
        if not HASH_RE.fullmatch(digest):
            raise InvalidRequest(f"hash: {digest[:80]!r} is not a SHA-256 in hex", field="hash")

    def has_files(self, name: str, digest: str) -> bool:
        """Whether the archive ``digest`` of template ``name`` (the acting team's own)
        was uploaded. Raises NotFound (no such template), InvalidRequest (not a hash),
        Forbidden (the operator's, to a team)."""
        name = self._named(name, change=True)
        self._check_hash(digest)
        return self._archive(name, digest).is_file()

    def upload_token(self, name: str, digest: str) -> str:
        """A token that lets its holder upload archive ``digest`` of ``name`` (the acting
        team's own) for ``UPLOAD_TTL_S`` (and do nothing else): ``EXPIRY.MAC``, or
        ``EXPIRY.TEAM.MAC`` for a team's template. Raises as ``has_files``."""
        stored = self._named(name, change=True)
        expiry = int(time.time()) + UPLOAD_TTL_S
        team = owner_of(stored)
        return f"{expiry}.{team + '.' if team else ''}{self._mac(stored, digest, expiry)}"

    def check_upload_token(self, name: str, digest: str, token: str) -> str | None:
        """The stored name of the template whose upload ``token`` opens (``name`` as the
        upload's URL gives it), or None when it opens none (forged, expired, another
        archive's or template's)."""
        expiry, _, rest = token.partition(".")
        team, _, mac = rest.rpartition(".")
        if not expiry.isdigit() or len(expiry) > 12 or int(expiry) < time.time() or (
                team and not TEAM_NAME.fullmatch(team)):
            return None
        stored = scoped(name, team) if team else name
        return stored if hmac.compare_digest(mac, self._mac(stored, digest, int(expiry))) \
            else None

    def _mac(self, name: str, digest: str, expiry: int) -> str:
        key = hmac.new(self.m.port_key, b"hangar template upload", hashlib.sha256).digest()
        return hmac.new(key, f"{name}\0{digest}\0{expiry}".encode(), hashlib.sha256).hexdigest()

    async def save_files(self, name: str, digest: str, chunks: AsyncIterator[bytes]) -> int:
        """Store an uploaded archive (a tar, gzip'd or not) as ``digest`` of the template stored as
        ``name`` (what ``check_upload_token`` gave); its size in bytes. An archive already stored
        stays as it is (the new body is dropped): a build checks an archive against its hash, then
        places it, and the upload link lives for an hour, so nothing may swap an archive in between
        (a failed check removes the archive instead: ``_check_upload``). Raises NotFound (also when
        the template is removed during the upload), InvalidRequest, TooLarge (past ``UPLOAD_MAX``;
        nothing is kept)."""
        self._template(name)
        self._check_hash(digest)
        dest = self._archive(name, digest)
        dest.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = dest.with_name(f".{digest}.{uuid.uuid4().hex}")
        size = 0
        try:
            with open(tmp, "xb") as f:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > UPLOAD_MAX:
                        raise TooLarge(f"the upload is larger than {UPLOAD_MAX} bytes",
                                       limit_bytes=UPLOAD_MAX)
                    await asyncio.to_thread(f.write, chunk)
            # no await from here on: a removal of the template runs before or after this
            self._template(name)
            if not dest.exists():
                try:
                    os.replace(tmp, dest)
                except FileNotFoundError:  # removed and made again during the upload
                    raise NotFound(f"template {name!r} was removed during the upload",
                                   template=name) from None
        finally:
            tmp.unlink(missing_ok=True)
        return size

    async def _check_upload(self, name: str, step: Copy, index: int) -> None:
        path = self._archive(name, step.files)
        if not path.is_file():
            raise StepFailed(f"the files of COPY {step.src} {step.dest} were not uploaded "
                             f"(hash {step.files})", index)
        try:
            got = await asyncio.to_thread(archive_hashes, path, step.src, step.dest)
        except (tarfile.TarError, OSError, ValueError, EOFError) as e:
            path.unlink(missing_ok=True)  # E2B's SDK uploads again once it is not present
            raise StepFailed(f"the upload for COPY {step.src} {step.dest} is not a tar "
                             f"archive: {str(e)[:200]}", index) from None
        if step.files not in got:
            path.unlink(missing_ok=True)
            raise StepFailed(f"the upload for COPY {step.src} {step.dest} does not match its "
                             "hash (an e2b SDK before 2.63 hashes a folder's size on disk, "
                             "which no archive carries: with a folder other than 4096 bytes, "
                             "upgrade the e2b package)", index)

