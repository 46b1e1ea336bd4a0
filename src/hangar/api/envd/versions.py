"""What this data plane tells E2B's SDKs about itself.

``ENVD_VERSION`` (defined once, in ``hangar.core.e2b``) is the envd version E2B's
control plane reports for a sandbox (``envdVersion``); the SDK turns features on by it. 0.6.4 is the
highest that promises nothing Hangar lacks: ``stdin=false`` (0.3.0), no
forced user (0.4.0), ``close_stdin`` (0.5.2), octet-stream uploads (0.5.7),
file metadata in xattrs (0.6.2), entries in watch events (0.6.3) and
``allow_network_mounts`` on a watch (0.6.4) are served.
"""

from hangar.core.service import e2b

__all__ = ["ENVD_PORT", "ENVD_VERSION", "PREFIX"]

ENVD_VERSION = e2b.ENVD_VERSION
"""The envd version E2B's SDKs are told (defined in ``hangar.core.e2b``)."""
ENVD_PORT = e2b.ENVD_PORT
"""The guest port E2B's SDK names in ``E2b-Sandbox-Port`` for envd itself (49983)."""
PREFIX = "/e2b/envd"
"""Where the data plane is served: ``E2B_SANDBOX_URL=http://HOST:8080/e2b/envd``."""
