"""``python -m hangar.cli``: the ``hangar`` command line."""

from hangar.cli.main import app

app()
