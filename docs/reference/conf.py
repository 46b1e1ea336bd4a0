"""Sphinx configuration of the SDK reference (built from the docstrings).

Build: ``.venv/bin/python -m sphinx -W --keep-going -b html docs/reference build/docs``;
the test suite does so with warnings as errors (tests/test_sdk_package.py).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from hangar import __version__  # noqa: E402

project = "Hangar SDK"
author = "Hangar"
release = version = __version__
extensions = ["sphinx.ext.autodoc"]
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_class_signature = "separated"
autodoc_default_options = {"members": True, "show-inheritance": True}
default_role = "literal"
html_theme = "alabaster"
html_static_path: list[str] = []
exclude_patterns = ["_build"]
