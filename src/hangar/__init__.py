"""Hangar: a self-hosted orchestrator of microVM sandboxes for AI agents.

This module stays import-light on purpose: the guest image carries
``hangar/__init__.py`` and ``hangar/guest/`` only, and runs them on the
guest's bare Python standard library.
"""

__version__ = "0.1.0"
