"""Peer routers for the benchmark: the vLLM router and the SGLang model gateway (smg), beside
sluicegate in front of the same engines.

Both come from the package index, pinned (PEERS), into a venv of the benchmark's own under the
engine fleet's home (`peers-venv`, installed once, with a stamp and a lock so that two runs do
not install at the same time). `start()` runs one on loopback in front of given engine URLs
with a given policy, in a process group of its own (never a session of its own), and waits for
its `/health`; `Peer.stop()` ends that group: SIGTERM, then SIGKILL after a grace. Used by
`--only kv_real` (bench/scenarios/kv_real.py) and reusable by any scenario that races them.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support.harness import free_port

PEERS = {"vllm-router": "vllm-router==0.1.17", "smg": "smg==1.13.0"}
START_S = 60.0  # seconds a peer may take to answer /health
LOG_LEVEL = {"vllm-router": "warning", "smg": "warn"}  # each one's spelling of it


def venv_dir(home: Path) -> Path:
    return home / "peers-venv"


def ensure_peers(home: Path) -> Path:
    """The bin directory of a venv holding every peer in PEERS, installed now if it is not."""
    venv = venv_dir(home)
    stamp = venv / (".ready-" + "-".join(sorted(PEERS.values())))
    if stamp.exists():
        return venv / "bin"
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".peers-install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another installer finishes first; then its stamp
        if not stamp.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
            subprocess.run([*pip, *PEERS.values()], check=True, stdin=subprocess.DEVNULL)
            stamp.touch()
    return venv / "bin"


@dataclass
class Peer:
    kind: str
    policy: str
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def wait_healthy(self, timeout_s: float = START_S) -> None:
        """Until its `/health` answers 200; stopped and TimeoutError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.kind} exited with {self.proc.returncode}: "
                    f"{self.log.read_text()[-2000:]}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(
            f"{self.kind} not healthy after {timeout_s:g} s: {self.log.read_text()[-2000:]}"
        )

    def stop(self, grace: float = 5.0) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(grace)


def argv(kind: str, policy: str, port: int, engines: list[str], extra: list[str]) -> list[str]:
    """One peer's command line (both take the same core flags; smg's under `launch`). Each
    gets its own Prometheus port: both default to a fixed one, which two peers would share.
    Both log at warning level, as every router does when measured (at info the vLLM router
    writes a line per pick)."""
    if kind not in PEERS:
        raise ValueError(f"unknown peer {kind!r}: one of {sorted(PEERS)}")
    return [
        kind,
        *(["launch"] if kind == "smg" else []),
        "--prometheus-port",
        str(free_port()),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *engines,
        "--policy",
        policy,
        "--log-level",
        LOG_LEVEL[kind],
        *extra,
    ]


def start(
    bin_dir: Path,
    kind: str,
    policy: str,
    engines: list[str],
    log: Path,
    extra: list[str] | None = None,
    wait: bool = True,
) -> Peer:
    """`kind` (a key of PEERS) with `policy` in front of `engines`, on a free loopback port;
    healthy on return unless not `wait` (then `wait_healthy()` is the caller's)."""
    port = free_port()
    cmd = argv(kind, policy, port, engines, extra or [])
    cmd[0] = str(bin_dir / cmd[0])
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "RUST_LOG": "warn"},
            process_group=0,
        )
    peer = Peer(kind, policy, f"http://127.0.0.1:{port}", proc, log)
    if wait:
        peer.wait_healthy()
    return peer
