"""Records as the API shows them: a sandbox record to its wire schema (``hangar.schemas``).

The API's routes answer with these, and a cluster node stores the same view
in its directory record (``status.view``), so a sandbox whose node is lost is
still shown exactly as its node last showed it.
"""

from __future__ import annotations

from hangar.core.lifecycle import Face, public_name
from hangar.core.store import SandboxRecord
from hangar.images import image_id
from hangar.schemas import SandboxInfo


def user_metadata(rec: SandboxRecord) -> dict[str, str]:
    """The client's metadata of ``rec`` (string keys and values; anything else a damaged
    or old record holds is left out)."""
    raw = rec.metadata_
    if not isinstance(raw, dict):
        return {}
    return {k: v for k, v in raw.items() if isinstance(k, str) and isinstance(v, str)}


def sandbox_view(rec: SandboxRecord) -> SandboxInfo:
    """What ``GET /sandboxes/{id}`` shows of ``rec`` (without the live memory figures)."""
    return SandboxInfo(
        id=rec.id, state=public_name(rec.state, Face.NATIVE) or rec.state.value, image=rec.image,
        image_id=image_id(rec.image, rec.image_digest), engine=rec.engine, accel=rec.accel,
        vcpus=rec.vcpus, memory_mib=rec.memory_mib, disk_mib=rec.disk_mib,
        created_at=rec.created_at, expires_at=rec.expires_at, error=rec.error,
        metadata=user_metadata(rec),
        desktop=rec.desktop, network=rec.network, source=rec.source,
    )
