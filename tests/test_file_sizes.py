"""No hand-written source file under src/ is over 600 lines: a longer one does several
jobs, and is split into modules named for their role (issue 28).

Generated files (their first line starts with ``# Generated from``, such as the blocking
SDK in ``hangar/client/_sync/``, made by scripts/gen_sync.py) follow their source and are
not counted; their source is.
"""

from __future__ import annotations

from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
MAX_LINES = 600
SOURCES = ("*.py", "*.js", "*.css", "*.html", "*.conf", "*.java", "*.R")


def hand_written() -> list[Path]:
    """Every source file under src/ (Python, the web page's, templates, the guest's kernel
drivers), generated ones
    left out."""
    files = sorted({p for pattern in SOURCES for p in SRC.rglob(pattern)
                    if "__pycache__" not in p.parts})
    assert files, f"no sources under {SRC}"
    return [p for p in files if not p.read_text().startswith("# Generated from")]


def test_no_hand_written_source_file_is_over_600_lines() -> None:
    long = {str(p.relative_to(SRC)): n for p in hand_written()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"over {MAX_LINES} lines (split them by job): {long}"


def test_generated_files_are_the_sync_twins() -> None:
    """Only the blocking SDK is generated, so the exemption covers nothing else."""
    generated = [p for p in SRC.rglob("*.py") if p.read_text().startswith("# Generated from")]
    assert generated and all(p.parent == SRC / "hangar/client/_sync" for p in generated)
