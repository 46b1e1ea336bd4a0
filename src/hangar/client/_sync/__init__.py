"""The blocking clients, generated from ``hangar.client._async`` by ``scripts/gen_sync.py``."""
