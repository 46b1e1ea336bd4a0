"""``python -m hangar.engines.firecracker [--dir DIR] [--force]``: fetch the binaries.

See ``hangar.engines.firecracker.binaries`` (``scripts/fetch-firecracker.sh`` runs this).
"""

import sys

from hangar.engines.firecracker.binaries import main

sys.exit(main())
