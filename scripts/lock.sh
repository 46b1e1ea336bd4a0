#!/usr/bin/env bash
# Regenerate requirements.lock: the exact versions of every dependency (SDK, server,
# tests, docs) within the ranges of pyproject.toml. install.sh and CI install from it.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m piptools compile --quiet --extra server --extra tools --extra test --extra docs --extra bench \
  --strip-extras --no-emit-index-url --no-emit-find-links --no-emit-trusted-host \
  --allow-unsafe --output-file requirements.lock pyproject.toml "$@"
