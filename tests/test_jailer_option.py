"""Firecracker runs as root without its jailer only when asked (HANGAR_FIRECRACKER_JAILER=off).

This host boots no guest under Firecracker, but the refusal comes before any
boot: when the engine is built, which is when the server starts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SRC, make_data_dir
from hangar.engines.doctor import jailer_choice
from hangar.engines.firecracker import UNJAILED_REFUSED, FirecrackerEngine
from hangar.errors import EngineError

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the refusal is for root")


def test_engine_refuses_to_run_unjailed_as_root() -> None:
    with pytest.raises(EngineError) as exc:
        FirecrackerEngine(Path("/nonexistent/firecracker"))
    assert exc.value.message == UNJAILED_REFUSED
    assert "HANGAR_FIRECRACKER_JAILER=off" in exc.value.message


def test_auto_without_a_jailer_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HANGAR_JAILER", "/nonexistent/jailer")
    with pytest.raises(EngineError) as exc:
        jailer_choice("auto")
    assert "no jailer found" in exc.value.message and UNJAILED_REFUSED in exc.value.message
    assert jailer_choice("off") == (None, "turned off (HANGAR_FIRECRACKER_JAILER=off)")


def test_server_with_firecracker_and_no_jailer_does_not_start(base_image) -> None:  # noqa: ANN001
    """``hangar serve`` with HANGAR_ENGINE=firecracker and no jailer exits with the reason."""
    d = make_data_dir(base_image)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "hangar.cli", "serve", "--port", "1"], capture_output=True,
            text=True, timeout=120,
            env={**os.environ, "PYTHONPATH": str(SRC), "HANGAR_DATA_DIR": str(d),
                 "HANGAR_ENGINE": "firecracker", "HANGAR_JAILER": "/nonexistent/jailer",
                 "HANGAR_NETWORK": "off"})
    finally:
        import shutil
        shutil.rmtree(d, ignore_errors=True)
    assert out.returncode != 0
    assert "HANGAR_FIRECRACKER_JAILER=off" in out.stdout + out.stderr, out.stderr[-2000:]
