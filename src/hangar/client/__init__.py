"""Python SDK for Hangar's REST API: ``Hangar`` (sync) and ``AsyncHangar``.

Both share one core (``hangar.client._core``) that builds requests and
maps error responses back to the ``hangar.errors`` hierarchy, so a caller
retries on ``err.retryable``, not on status codes::

    from hangar.client import Hangar
    with Hangar() as h:                    # HANGAR_URL, HANGAR_API_KEY or the key file
        sb = h.create()
        print(h.exec(sb["id"], "uname -a")["stdout"])
        h.write_file(sb["id"], "/root/x.bin", b"\\x00\\x01")
        h.delete(sb["id"])
"""

from hangar.client.sync import Hangar
from hangar.client.aio import AsyncHangar

__all__ = ["Hangar", "AsyncHangar"]
