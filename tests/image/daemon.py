"""A private dockerd for the image test: its own socket, data root and exec root under a temporary
directory, no iptables and no bridge (containers use the host's network), stopped by its PID.

Debian's `docker.io` (dockerd and a client of the same version) is what runs on these machines;
`ensure_tools()` installs it, and mmdebstrap for the local base, when they are absent.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

DOCKER = "/usr/bin/docker"  # Debian's client: it builds with the daemon's BuildKit
DOCKERD = "/usr/sbin/dockerd"


def ensure_tools() -> None:
    missing = [
        pkg
        for pkg, path in (("docker.io", DOCKERD), ("docker.io", DOCKER))
        if not Path(path).exists()
    ]
    if shutil.which("mmdebstrap") is None:
        missing.append("mmdebstrap")
    if not missing:
        return
    packages = sorted(set(missing))
    print(f"image-test: installing {' '.join(packages)}", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, stdout=subprocess.DEVNULL)
    subprocess.run(
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages],
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
    )


class Daemon:
    """dockerd under `root`; `env` is what a docker client needs to reach it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.sock = root / "docker.sock"
        self.log = root / "dockerd.log"
        self.pidfile = root / "dockerd.pid"
        self.env = {**os.environ, "DOCKER_HOST": f"unix://{self.sock}", "DOCKER_BUILDKIT": "1"}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> str | None:
        """Start and wait until it answers; None when ready, else why it did not start."""
        cmd = [
            DOCKERD,
            "--iptables=false",
            "--ip6tables=false",
            "--bridge=none",
            f"--data-root={self.root / 'data'}",
            f"--exec-root={self.root / 'exec'}",
            f"--pidfile={self.pidfile}",
            f"--host=unix://{self.sock}",
        ]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return f"dockerd exited with {self.proc.returncode}: {self._last_log_line()}"
            ok = subprocess.run(
                [DOCKER, "version", "--format", "{{.Server.Version}}"],
                env=self.env,
                capture_output=True,
                timeout=10,
            )
            if ok.returncode == 0:
                return None
            time.sleep(0.3)
        return f"dockerd did not answer within {timeout:.0f} s: {self._last_log_line()}"

    def _last_log_line(self) -> str:
        try:
            lines = self.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return lines[-1][:300] if lines else "(empty log)"

    def stop(self) -> None:
        """SIGTERM by PID (dockerd stops its containers and its containerd), SIGKILL the
        process group if it is still there after 30 s, then unmount what it left."""
        if self.proc is None or self.proc.poll() is not None:
            self._unmount()
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._unmount()

    def _unmount(self) -> None:
        prefix = str(self.root) + "/"
        with open("/proc/self/mounts") as f:
            points = [line.split()[1] for line in f if line.split()[1].startswith(prefix)]
        for point in sorted(points, key=len, reverse=True):
            subprocess.run(["umount", "-l", point], capture_output=True)
