"""The asyncio client under its 0.1 import path (``hangar.client.aio.AsyncHangar``)."""

from hangar.client._async.client import AsyncHangar

__all__ = ["AsyncHangar"]
