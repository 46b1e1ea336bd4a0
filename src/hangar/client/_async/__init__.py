"""The asyncio clients: the one source from which ``hangar.client._sync`` is generated."""
