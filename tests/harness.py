"""Real processes on loopback ports for the tests: mock upstreams, routers, redis-server.

Every process is started by the test session, stopped by its PID at teardown, and waited for with
a bounded deadline.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(
    url: str, deadline_s: float = 15.0, proc: subprocess.Popen[bytes] | None = None
) -> None:
    end = time.monotonic() + deadline_s
    last: Exception | None = None
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with {proc.returncode}")
        try:
            r = httpx.get(url, timeout=1.0)
            if r.status_code < 500:
                return
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.05)
    raise TimeoutError(f"{url} not up after {deadline_s}s: {last!r}")


class Proc:
    def __init__(self, popen: subprocess.Popen[bytes], port: int, log_path: Path) -> None:
        self.popen = popen
        self.port = port
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{port}"

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.popen.pid, sig)

    def stop(self, grace: float = 5.0) -> int | None:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        return self.popen.returncode

    def kill9(self) -> None:
        if self.alive():
            self.popen.kill()
            self.popen.wait(5)


class Cluster:
    """Starts and tracks processes; `close()` stops every one it started."""

    def __init__(self) -> None:
        self.procs: list[Proc] = []
        self.tmp = Path(tempfile.mkdtemp(prefix="sluicegate-test-"))

    def _spawn(self, args: list[str], port: int, name: str, env: dict[str, str] | None) -> Proc:
        log_path = self.tmp / f"{name}-{port}.log"
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        fh = open(log_path, "wb")
        popen = subprocess.Popen(
            args,
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
        )
        fh.close()
        proc = Proc(popen, port, log_path)
        self.procs.append(proc)
        return proc

    def mock(
        self,
        name: str = "mock",
        port: int | None = None,
        ttft_ms: float = 0,
        itl_ms: float = 0,
        tokens: int = 16,
        host: str = "127.0.0.1",
    ) -> Proc:
        port = port or free_port()
        proc = self._spawn(
            [
                sys.executable,
                "-m",
                "router.cli",
                "mock-upstream",
                "--host",
                host,
                "--port",
                str(port),
                "--name",
                name,
                "--ttft-ms",
                str(ttft_ms),
                "--itl-ms",
                str(itl_ms),
                "--tokens",
                str(tokens),
            ],
            port,
            f"mock-{name}",
            None,
        )
        proc.url = f"http://{host}:{port}"
        wait_http(proc.url + "/health", proc=proc.popen)
        return proc

    def write_config(self, config: dict[str, Any]) -> Path:
        path = self.tmp / f"config-{len(self.procs)}-{time.monotonic_ns()}.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    def router(
        self,
        config: dict[str, Any],
        env: dict[str, str] | None = None,
        workers: int = 1,
        port: int | None = None,
        wait: bool = True,
    ) -> Proc:
        port = port or free_port()
        path = self.write_config(config)
        env = {"SLUICEGATE_LOG_LEVEL": "info", **(env or {})}
        proc = self._spawn(
            [
                sys.executable,
                "-m",
                "router.cli",
                "serve",
                "--config",
                str(path),
                "--port",
                str(port),
                "--host",
                "127.0.0.1",
                "--workers",
                str(workers),
            ],
            port,
            "router",
            env,
        )
        if wait:
            wait_http(proc.url + "/healthz", proc=proc.popen)
        return proc

    def redis(self, port: int | None = None) -> Proc:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: `make test` installs it")
        port = port or free_port()
        proc = self._spawn(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "yes",
            ],
            port,
            "redis",
            None,
        )
        end = time.monotonic() + 10
        while time.monotonic() < end:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                break
            time.sleep(0.05)
        proc.url = f"redis://127.0.0.1:{port}/0"
        return proc

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.stop(grace=5)
        shutil.rmtree(self.tmp, ignore_errors=True)


def backend(name: str, mock: Proc, models: Any = None, **extra: Any) -> dict[str, Any]:
    return {"name": name, "url": mock.url, "models": models or {"m": "mock-model"}, **extra}


def control(mock: Proc, **changes: Any) -> dict[str, Any]:
    r = httpx.post(mock.url + "/control", json=changes, timeout=5)
    r.raise_for_status()
    return dict(r.json())


def in_flight(router: Proc) -> int:
    """The router's in-flight count over all its backends, as its admin API reports it."""
    r = httpx.get(router.url + "/admin/backends", timeout=5)
    r.raise_for_status()
    return sum(int(b["in_flight"]) for b in r.json())


def stats(mock: Proc) -> dict[str, Any]:
    r = httpx.get(mock.url + "/stats", timeout=5)
    r.raise_for_status()
    return dict(r.json())
