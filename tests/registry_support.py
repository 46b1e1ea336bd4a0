"""A real OCI registry on loopback for tests: Debian's ``docker-registry`` (the
distribution project's registry), started on a free port with its storage in a folder of
the test's, and images pushed to it with ``skopeo``. Nothing reaches the internet."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx

from conftest import free_port

REGISTRY = "/usr/bin/docker-registry"


def available() -> bool:
    return Path(REGISTRY).exists() and shutil.which("skopeo") is not None


class LocalRegistry:
    """``docker-registry serve`` on ``127.0.0.1:<port>`` (plain HTTP), ended by its pid."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> "LocalRegistry":
        self.folder.mkdir(parents=True, exist_ok=True)
        config = self.folder / "config.yml"
        config.write_text(
            "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n"
            f"    rootdirectory: {self.folder / 'data'}\n  delete:\n    enabled: true\n"
            f"http:\n  addr: 127.0.0.1:{self.port}\n")
        self.log = open(self.folder / "registry.log", "wb")
        self.proc = subprocess.Popen([REGISTRY, "serve", str(config)], stdout=self.log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"http://{self.host}/v2/", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError("the local registry did not start: "
                                   + (self.folder / "registry.log").read_text()[-2000:])
            time.sleep(0.2)

    def push(self, source: str, repo: str) -> None:
        """Copy ``source`` (a skopeo reference: ``docker-archive:PATH``...) to ``repo``
        (``library/tiny:1``) of this registry."""
        subprocess.run(["skopeo", "--insecure-policy", "copy", "--quiet",
                        "--dest-tls-verify=false", source, f"docker://{self.host}/{repo}"],
                       check=True, capture_output=True, timeout=300)

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        self.log.close()
