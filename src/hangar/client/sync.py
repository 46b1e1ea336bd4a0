"""The blocking client under its 0.1 import path (``hangar.client.sync.Hangar``)."""

from hangar.client._sync.client import Hangar

__all__ = ["Hangar"]
