"""Real processes on loopback ports for the tests: mock upstreams, routers, redis-server.

Every process is started by the test session, stopped by its PID at teardown, and waited for with
a bounded deadline.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
import yaml
from prometheus_client.parser import text_string_to_metric_families

from router.tools.enginefleet.fleet import below_ephemeral
from router.tools.enginefleet.fleet import free_port as fleet_free_port
from tests.support.zygote import Zygote, forkable

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")

# How long a test's client waits for an answer: it catches a hang and times nothing. In a full
# run on a loaded 2-core machine every process was starved at once for ~40 s (a fixture's setup
# and two tests on other workers, each 40 s in the same window; the router's own requests take
# ~2 ms there), so 5-10 s read timeouts failed tests whose router was only waiting for a CPU.
# What a test holds the router to is its settings' timeouts (`late_by`), not this.
STARVED_S = 60.0


@functools.cache
def _port_slice() -> range:
    """This test process's ports: its own slice of the span below the ephemeral range, one per
    xdist worker. Ports from bind(0) came from one pool for every worker: a server that lost its
    port to another worker's server between the choice and its bind left its test talking to
    that other server (a console test read another router's live view)."""
    span = below_ephemeral()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1))
    index = int(worker[2:]) % count if worker.startswith("gw") and worker[2:].isdigit() else 0
    size = len(span) // count
    return span[index * size : (index + 1) * size]


def free_port() -> int:
    """A port on 127.0.0.1 nothing holds now, from this process's slice (`_port_slice`), never
    handed out before by this process (a test may point a router at a port it keeps dead); one
    record with the engine fleet's own ports (`router.tools.enginefleet.fleet.free_port`)."""
    return fleet_free_port(_port_slice())


def _log_tail(proc: subprocess.Popen[bytes]) -> str:
    """The end of a dead process's log, so that a failed start says why (the log's directory is
    removed when the test ends)."""
    log = getattr(proc, "log_path", None)
    if log is None:
        return ""
    try:
        tail = Path(log).read_text(errors="replace").splitlines()[-15:]
    except OSError:
        return ""
    return ":\n" + "\n".join(tail)


def wait_http(
    url: str, deadline_s: float = 90.0, proc: subprocess.Popen[bytes] | None = None
) -> None:
    """Until `url` answers below 500. `deadline_s` bounds only a start that never comes (a
    process that exits fails at once): several routers of two workers starting together on a
    loaded 2-core machine were seen to take over 30 s, so it is generous."""
    end = time.monotonic() + deadline_s
    last: Exception | None = None
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with {proc.returncode}{_log_tail(proc)}")
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
                # A starved machine can take seconds to reap even a killed process.
                self.popen.wait(STARVED_S)
        return self.popen.returncode

    def kill9(self) -> None:
        if self.alive():
            self.popen.kill()
            self.popen.wait(STARVED_S)


class Cluster:
    """Starts and tracks processes; `close()` stops every one it started."""

    def __init__(self) -> None:
        self.procs: list[Proc] = []
        self.tmp = Path(tempfile.mkdtemp(prefix="sluicegate-test-"))

    def _spawn(
        self,
        args: list[str],
        port: int,
        name: str,
        env: dict[str, str] | None,
        cwd: Path | str = ROOT,
    ) -> Proc:
        log_path = self.tmp / f"{name}-{port}.log"
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        fh = open(log_path, "wb")
        if forkable(args, full_env, cwd):
            fh.close()
            forked = Zygote.spawn(args, full_env, cwd, log_path)
            if forked is not None:
                proc = Proc(forked, port, log_path)  # type: ignore[arg-type]
                self.procs.append(proc)
                return proc
            fh = open(log_path, "wb")
        popen = subprocess.Popen(
            args,
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
        )
        fh.close()
        popen.log_path = log_path  # type: ignore[attr-defined]
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
        engine_args: list[str] | None = None,
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
                *(engine_args or []),
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
        src: str | None = None,
    ) -> Proc:
        """A router; with `src`, run from that checkout's code (a benchmark's baseline)."""
        port = port or free_port()
        path = self.write_config(config)
        env = {
            "SLUICEGATE_LOG_LEVEL": "info",
            **(env or {}),
            **({"PYTHONPATH": src} if src else {}),
        }
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
            cwd=src or ROOT,
        )
        if wait:
            wait_http(proc.url + "/healthz", proc=proc.popen)
        return proc

    def redis(self, port: int | None = None) -> Proc:
        proc = self.redis_node(port or free_port(), "--protected-mode", "yes")
        proc.url += "/0"
        return proc

    def redis_node(
        self, port: int, *extra: str, conf: Path | None = None, name: str = "redis"
    ) -> Proc:
        """A redis-server (a sentinel with `conf`) with `extra` arguments, up on `port`."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: `make redis-server` installs it")
        args = [binary, str(conf), "--sentinel"] if conf else [binary]
        args += ["--port", str(port), "--bind", "127.0.0.1"]
        if conf is None:
            # Its own directory: a replica's full sync writes dump.rdb there, and a server
            # started where one lies would load it. No saving; on SIGTERM, no wait for replicas.
            workdir = self.tmp / f"redis-{port}"
            workdir.mkdir(exist_ok=True)  # a restart on the same port (it saves nothing)
            args += ["--dir", str(workdir), "--save", "", "--appendonly", "no"]
            args += ["--shutdown-on-sigterm", "now"]
        proc = self._spawn([*args, *extra], port, name, None)
        end = time.monotonic() + 10
        while "PONG" not in _cli(port, "PING"):
            if not proc.alive() or time.monotonic() > end:
                raise RuntimeError(f"{name} on port {port} did not start: {proc.log()[-500:]}")
            time.sleep(0.05)
        proc.url = f"redis://127.0.0.1:{port}"
        return proc

    def redis_cluster(self, masters: int = 3) -> list[Proc]:
        """A Redis Cluster of `masters` primaries (no replicas) on loopback, slots all covered."""
        nodes = []
        for _ in range(masters):
            nodes.append(
                self.redis_node(
                    free_port(),
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-port",  # the bus; by default port + 10000, maybe taken
                    str(free_port()),
                    "--cluster-node-timeout",
                    "2000",
                    name="cluster",
                )
            )
        created = subprocess.run(
            [
                _redis_cli(),
                "--cluster",
                "create",
                *(f"127.0.0.1:{n.port}" for n in nodes),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            capture_output=True,
            timeout=30,
            text=True,
        )
        if created.returncode != 0:
            raise RuntimeError(
                f"redis-cli --cluster create failed: {(created.stdout + created.stderr)[-500:]}"
            )
        end = time.monotonic() + 15
        while any("cluster_state:ok" not in _cli(n.port, "CLUSTER", "INFO") for n in nodes):
            if time.monotonic() > end:
                raise TimeoutError("redis cluster did not reach cluster_state:ok")
            time.sleep(0.1)
        return nodes

    def redis_sentinel(self, master_name: str = "mymaster") -> tuple[Proc, Proc, list[Proc]]:
        """A master, its replica (in sync) and three sentinels watching them (quorum 2)."""
        master = self.redis_node(free_port())
        replica = self.redis_node(free_port(), "--replicaof", "127.0.0.1", str(master.port))
        sentinels = []
        for _ in range(3):
            port = free_port()
            conf = self.tmp / f"sentinel-{port}.conf"
            conf.write_text(
                f"sentinel monitor {master_name} 127.0.0.1 {master.port} 2\n"
                # Only the test's SENTINEL FAILOVER moves the master: on a starved machine a short
                # down-after could see a slow server as down and fail over again on its own.
                f"sentinel down-after-milliseconds {master_name} 5000\n"
                f"sentinel failover-timeout {master_name} 5000\n"
                f"dir {self.tmp}\n"
            )
            sentinels.append(self.redis_node(port, conf=conf, name="sentinel"))
        end = time.monotonic() + 20

        def ready() -> bool:
            if "master_link_status:up" not in _cli(replica.port, "INFO", "replication"):
                return False
            for s in sentinels:  # each knows the replica and the two other sentinels
                info = _cli(s.port, "SENTINEL", "MASTER", master_name)
                fields = dict(zip(info.split("\n")[::2], info.split("\n")[1::2], strict=False))
                if fields.get("num-slaves") != "1" or fields.get("num-other-sentinels") != "2":
                    return False
            return True

        while not ready():
            if time.monotonic() > end:
                raise TimeoutError("sentinels did not see the replica and each other")
            time.sleep(0.1)
        return master, replica, sentinels

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.stop(grace=5)
        shutil.rmtree(self.tmp, ignore_errors=True)


def backend(name: str, mock: Proc, models: Any = None, **extra: Any) -> dict[str, Any]:
    return {"name": name, "url": mock.url, "models": models or {"m": "mock-model"}, **extra}


def control(mock: Proc, **changes: Any) -> dict[str, Any]:
    r = httpx.post(mock.url + "/control", json=changes, timeout=STARVED_S)
    r.raise_for_status()
    return dict(r.json())


def admin_backends(
    router: Proc, headers: dict[str, str] | None = None
) -> dict[str, dict[str, Any]]:
    """The router's backends as its admin API lists them, by URL."""
    r = httpx.get(router.url + "/admin/backends", timeout=5, headers=headers)
    r.raise_for_status()
    return {row["url"]: row for row in r.json()}


def streamed_chat(
    router: Proc, content: str, max_tokens: int, headers: dict[str, str] | None = None
) -> httpx.Response:
    """One streamed chat completion for model `m`, read to its end; its response."""
    with httpx.stream(
        "POST",
        router.url + "/v1/chat/completions",
        json={
            "model": "m",
            "stream": True,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": content}],
        },
        headers=headers or {},
        timeout=30,
    ) as r:
        r.read()
        return r


def in_flight(router: Proc) -> int:
    """The router's in-flight count over all its backends, as its admin API reports it."""
    r = httpx.get(router.url + "/admin/backends", timeout=STARVED_S)
    r.raise_for_status()
    return sum(int(b["in_flight"]) for b in r.json())


def metric(router: Proc, name: str, **labels: str) -> float:
    """The sum of the router's `/metrics` samples named `name` whose labels include `labels`."""
    page = httpx.get(router.url + "/metrics", timeout=STARVED_S).text
    return sum(
        s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


async def late_by(work: Awaitable[T], seconds: float) -> tuple[T, float]:
    """`work`'s result, and how long after a timer of `seconds` started with it it ended
    (negative: before the timer). The timer's own lateness is the machine's, so a bound on this
    holds the work to its timeouts, not to how busy the machine is."""
    loop = asyncio.get_running_loop()

    async def timed() -> tuple[T, float]:
        result = await work
        return result, loop.time()

    async def timer() -> float:
        await asyncio.sleep(seconds)
        return loop.time()

    (result, done), due = await asyncio.gather(timed(), timer())
    return result, done - due


def stats(mock: Proc, timeout: float = STARVED_S) -> dict[str, Any]:
    r = httpx.get(mock.url + "/stats", timeout=timeout)
    r.raise_for_status()
    return dict(r.json())


def booked(router: Proc, key: str, admin_token: str) -> dict[str, int]:
    """The key's totals in the router's usage book (`GET /admin/usage`), over every hour."""
    r = httpx.get(
        router.url + "/admin/usage",
        params={"key": key},
        headers={"authorization": f"Bearer {admin_token}"},
        timeout=5,
    )
    r.raise_for_status()
    fields = ("prompt_tokens", "completion_tokens", "requests", "estimated_requests")
    return {f: sum(int(row[f]) for row in r.json()["data"]) for f in fields}


def _redis_cli() -> str:
    binary = shutil.which("redis-cli")
    if binary is None:
        raise RuntimeError("redis-cli is not installed: `make redis-server` installs it")
    return binary


def _cli(port: int, *command: str) -> str:
    """One command through redis-cli against a loopback port; its output ('' if it failed)."""
    out = subprocess.run(
        [_redis_cli(), "-h", "127.0.0.1", "-p", str(port), *command],
        capture_output=True,
        timeout=5,
        text=True,
    )
    return out.stdout.replace("\r", "")


def sha(key: str) -> str:
    """How the router names a client key where the key itself must not appear."""
    return hashlib.sha256(key.encode()).hexdigest()


def expected_text(n: int) -> str:
    """The mock engine's text for `n` tokens at its defaults."""
    return "".join(f"tok{i} " for i in range(n))


async def stream_text(client: openai.AsyncOpenAI, max_tokens: int) -> str:
    """One streamed chat completion for model `m`, its text joined."""
    stream = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=max_tokens
    )
    return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
