"""The files hash of a COPY's archive, as E2B's SDKs compute it on the client: the current
scheme (2.63 and later) and the one before (a folder's size on disk hashed too)."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from hangar.build_archive import archive_hashes, make_archive


def _sdk_hash(context: Path, src: str, dest: str, folder_size: bool) -> str:
    """The hash E2B's SDK gives ``COPY src dest`` (its ``calculate_files_hash``: relative
    path, then mode and size, a link's target or a file's bytes), a folder's size hashed
    only when ``folder_size`` (SDKs before 2.63)."""
    h = hashlib.sha256(f"COPY {src} {dest}".encode())
    top = context / src
    paths = [top, *sorted(p for p in top.rglob("*"))]
    for p in paths:
        h.update(os.path.relpath(p, context).encode())
        st = os.lstat(p)
        h.update(str(st.st_mode).encode())
        if not stat.S_ISDIR(st.st_mode) or folder_size:
            h.update(str(st.st_size if not stat.S_ISDIR(st.st_mode) else 4096).encode())
        if stat.S_ISLNK(st.st_mode):
            h.update(os.readlink(p).encode())
        elif stat.S_ISREG(st.st_mode):
            h.update(p.read_bytes())
    return h.hexdigest()


def test_both_sdk_schemes_of_a_folder_are_known(tmp_path: Path) -> None:
    app = tmp_path / "app"
    (app / "sub").mkdir(parents=True)
    (app / "a.txt").write_text("hi\n")
    (app / "sub" / "b.txt").write_text("yo\n")
    (app / "l.txt").symlink_to("a.txt")
    tar = make_archive(tmp_path, "app")
    try:
        assert archive_hashes(tar, "app", "site/") == (
            _sdk_hash(tmp_path, "app", "site/", folder_size=False),
            _sdk_hash(tmp_path, "app", "site/", folder_size=True))
    finally:
        tar.unlink(missing_ok=True)
