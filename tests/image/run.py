"""`make image-test`: build the container image as a user would and check it running.

    installs docker.io and mmdebstrap when absent, starts a private dockerd (tests/image/daemon.py)
      with its data on a tmpfs when there is the memory
    base: the Dockerfile's pinned official one when it can be pulled, else a local stand-in of the
      same Python (tests/image/base.py), made once and then imported from its cache
    builds the Dockerfile as committed (for a local base: the base and the CA path as build args)
    checks, every container read-only, as the image's non-root user, on the host's network:
      --help; a missing config (one line, exit 2); the lock matches pyproject.toml;
      the base's installers (pip; setuptools too on the local base) are gone from the image;
      bytecode for everything the router imports;
      against a mock engine: /healthz, /readyz, a streamed completion, /metrics, and Docker's
      HEALTHCHECK on a non-default port (from SLUICEGATE_PORT and from --port);
      --workers 2 without a writable /tmp (one line, exit 2) and with --tmpfs /tmp (serves);
      docker stop during a 12 s stream (longer than docker's default 10 s): the stream ends
      whole within --stop-timeout, /readyz says 503 meanwhile, the container exits 0
    stops what it started by PID (mock engines, dockerd) and removes its data root (images,
    containers, layers), whatever the outcome

When dockerd cannot start here it prints one line saying the test was skipped and exits 0: that
is not a pass, and the line says so. Anything else that fails exits 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from openai import OpenAI

from tests.image import base, daemon
from tests.support.harness import STARVED_S

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "sluicegate-image-test:latest"
LOCAL_BASE = "sluicegate-image-test-base"
FAST_TOKENS = 8
SLOW_TOKENS, SLOW_ITL_MS = 60, 200  # a 12 s stream
DRAIN_GRACE, STOP_TIMEOUT = 30, 40
TMPFS_SIZE, TMPFS_MIN_FREE = "4g", 6 << 30
T0 = time.monotonic()  # each check's line says when it passed, from the start


class Failed(Exception):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# Installers anywhere an image may have them: the system's and the router's site-packages,
# /usr/local/bin, ensurepip's bundled wheels.
INSTALLERS = (
    "import glob, json, re; "
    "names = re.compile(r'(pip|setuptools|wheel|pkg_resources|_distutils_hack)([-.]|$)'); "
    "found = [p for d in ('/usr/local/lib/python3*/site-packages/*', "
    "'/opt/sluicegate/lib/python3*/site-packages/*', '/usr/local/bin/*') "
    "for p in glob.glob(d) if names.match(p.rsplit('/', 1)[1])]; "
    "found += glob.glob('/usr/local/lib/python3*/ensurepip/_bundled/*.whl'); "
    "print(json.dumps(sorted(found)))"
)


def installers(paths: list[str]) -> list[str]:
    """The distributions among INSTALLERS' paths (`.../pip-23.2.1.dist-info` -> pip)."""
    names = {re.split(r"[-.]", p.rsplit("/", 1)[1], maxsplit=1)[0] for p in paths}
    return sorted({n.rstrip("0123456789") for n in names if not n.startswith("_")})


def base_python(image: str) -> str:
    """The Python version of a `python:X.Y-...` base reference."""
    match = re.match(r"(?:.*/)?python:(\d+\.\d+)", image)
    if match is None:
        raise Failed(f"Dockerfile: BASE_IMAGE {image} names no python:X.Y")
    return match.group(1)


def dockerfile_base() -> str:
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("ARG BASE_IMAGE="):
            return line.split("=", 1)[1].strip()
    raise Failed("Dockerfile: no `ARG BASE_IMAGE=` line")


class Run:
    def __init__(self, work: Path, dockerd: daemon.Daemon) -> None:
        self.work = work
        self.d = dockerd
        self.procs: list[subprocess.Popen[bytes]] = []
        self.passed: list[str] = []
        self.figures: dict[str, str] = {}

    # -- helpers ---------------------------------------------------------------------------

    def docker(
        self, *args: str, timeout: float = 120, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(
            [daemon.DOCKER, *args], env=self.d.env, capture_output=True, text=True, timeout=timeout
        )
        if check and out.returncode != 0:
            raise Failed(
                f"docker {' '.join(args[:3])}...: rc {out.returncode}: {out.stderr.strip()[-800:]}"
            )
        return out

    def ok(self, what: str) -> None:
        self.passed.append(what)
        print(f"image-test: ok ({time.monotonic() - T0:.0f} s): {what}", flush=True)

    def mock(self, tokens: int, itl_ms: float) -> int:
        port = free_port()
        cmd = [sys.executable, "-m", "router.cli", "mock-upstream", "--port", str(port)]
        cmd += ["--tokens", str(tokens), "--itl-ms", str(itl_ms), "--name", f"mock-{port}"]
        self.procs.append(subprocess.Popen(cmd, cwd=ROOT, start_new_session=True))
        self.wait_http(f"http://127.0.0.1:{port}/health", 20)
        return port

    def wait_http(self, url: str, timeout: float, status: int = 200) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            try:
                r = httpx.get(url, timeout=2)
                if r.status_code == status:
                    return
                last = f"HTTP {r.status_code}"
            except httpx.HTTPError as exc:
                last = type(exc).__name__
            time.sleep(0.2)
        raise Failed(f"{url}: no {status} within {timeout:.0f} s (last: {last})")

    def config(self, name: str, upstream: int, extra: str = "") -> Path:
        folder = self.work / f"config-{name}"
        folder.mkdir()
        (folder / "config.yaml").write_text(
            textwrap.dedent(f"""\
                backends:
                  - name: mock
                    url: http://127.0.0.1:{upstream}
                    models: {{m: mock-model}}
                health: {{interval: 1}}
                drain_grace: {DRAIN_GRACE}
                """)
            + extra
        )
        folder.chmod(0o755)
        (folder / "config.yaml").chmod(0o644)
        return folder

    def run_args(self, name: str, config: Path | None, *extra: str) -> list[str]:
        args = ["run", "--name", name, "--network", "host", "--read-only"]
        args += ["--health-interval", "1s", "--health-start-period", "1s"]
        if config is not None:
            # As docs/operations.md says: the one file, read-only (readable by uid 10001).
            args += ["-v", f"{config / 'config.yaml'}:/etc/sluicegate/config.yaml:ro"]
        return [*args, *extra]

    def start(self, name: str, config: Path, *extra: str, cmd: tuple[str, ...] = ()) -> None:
        self.docker(*self.run_args(name, config, "-d", *extra), IMAGE, *cmd)

    def logs(self, name: str) -> str:
        out = self.docker("logs", "--tail", "20", name, check=False)
        return (out.stdout + out.stderr).strip()[-1500:]

    def healthy(self, name: str, timeout: float = 120) -> float:
        """Seconds until Docker's HEALTHCHECK says healthy. The bound is for a loaded machine:
        there two workers each importing the router (10 s apiece at a load average of 30)
        took longer than the 30 s this once waited."""
        t0 = time.monotonic()
        st: dict[str, Any] = {}
        health = None
        while time.monotonic() - t0 < timeout:
            state = self.docker("inspect", "--format", "{{json .State}}", name).stdout
            st = json.loads(state)
            if not st.get("Running"):
                raise Failed(f"{name} stopped (exit {st.get('ExitCode')}): {self.logs(name)}")
            health = (st.get("Health") or {}).get("Status")
            if health == "healthy":
                return time.monotonic() - t0
            time.sleep(0.3)
        # What the probes said (each one's exit code and output), and what the router logged.
        probes = [
            f"rc {p.get('ExitCode')}: {str(p.get('Output', '')).strip()[:160]}"
            for p in ((st.get("Health") or {}).get("Log") or [])[-3:]
        ]
        raise Failed(
            f"{name}: Docker's HEALTHCHECK not healthy within {timeout:.0f} s "
            f"(status {health}; last probes: {probes}; logs: {self.logs(name)})"
        )

    def rm(self, *names: str) -> None:
        self.docker("rm", "-f", *names, check=False)

    def stream(
        self, port: int, timeout: float = 60, begun: threading.Event | None = None
    ) -> tuple[str, str | None]:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=timeout)
        text, finish = [], None
        for chunk in client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True
        ):
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
                if begun is not None and text[-1]:
                    begun.set()
        return "".join(text), finish

    def exec_py(self, name: str, code: str) -> str:
        return self.docker("exec", name, "python", "-c", code).stdout.strip()

    # -- steps -----------------------------------------------------------------------------

    def build(self) -> None:
        """The image on the Dockerfile's pinned base when it can be pulled, else on a local
        stand-in of the same Python (tests/image/base.py, cached between runs)."""
        official = dockerfile_base()
        version = base_python(official)
        build_args: list[str] = []
        t0 = time.monotonic()
        pulled = self.docker("pull", "-q", official, timeout=180, check=False)
        if pulled.returncode == 0:
            image_base = official
            print(f"image-test: base {official} (pulled)", flush=True)
        else:
            why = (pulled.stderr.strip().splitlines() or ["?"])[-1][:160]
            print(f"image-test: {official} cannot be pulled ({why})", flush=True)
            image_base = f"{LOCAL_BASE}:{version}"
            cached = base.make([daemon.DOCKER], self.d.env, self.work, image_base, version)
            how = "imported from the cache" if cached else "made and cached"
            self.figures["local base"] = f"{how} in {time.monotonic() - t0:.0f} s"
            size = self.size(image_base) / 1e6
            exact = self.docker("run", "--rm", image_base, "python", "-V").stdout.strip()
            print(
                f"image-test: base {image_base} ({exact}, {size:.0f} MB), {how} "
                f"({base.cache_dir()})",
                flush=True,
            )
            build_args = [
                "--build-arg",
                f"BASE_IMAGE={image_base}",
                "--build-arg",
                "PIP_CERT=/etc/ssl/certs/ca-certificates.crt",
            ]
        # The base's installers, looked for before the build so that none in the image means
        # the Dockerfile removed them (on an official 3.12 base there is only pip to remove).
        listed = installers(
            json.loads(
                self.docker(
                    "run", "--rm", "--entrypoint", "python", image_base, "-c", INSTALLERS
                ).stdout
            )
        )
        # A local base carries setuptools as well (as the official 3.11 one does).
        for name in ("pip", "setuptools") if build_args else ("pip",):
            if name not in listed:
                raise Failed(f"the base has no {name} to remove: {listed}")
        t0 = time.monotonic()
        self.docker(
            "build", "--network", "host", "-q", "-t", IMAGE, *build_args, str(ROOT), timeout=600
        )
        took = f"{time.monotonic() - t0:.0f} s"
        self.figures["build"] = took
        self.figures["image"] = f"{self.size(IMAGE) / 1e6:.0f} MB"
        self.ok(f"built on Python {version} in {took}, {self.figures['image']}")
        self.no_installers(IMAGE, listed)
        layers = self.docker("history", "--format", "{{.Size}}\t{{.CreatedBy}}", IMAGE).stdout
        for line in layers.splitlines():
            if not line.startswith("0B"):
                print(f"image-test: layer {line[:110]}", flush=True)

    def size(self, image: str) -> int:
        return int(self.docker("image", "inspect", "--format", "{{.Size}}", image).stdout)

    def no_installers(self, image: str, in_base: list[str]) -> None:
        """No pip, setuptools or wheel anywhere: the base's site-packages, the router's venv,
        ensurepip's bundled copies, /usr/local/bin."""
        out = json.loads(
            self.docker(
                "run", "--rm", "--read-only", "--entrypoint", "python", image, "-c", INSTALLERS
            ).stdout
        )
        if out:
            raise Failed(f"installers left in the image: {out}")
        self.ok(f"no pip, setuptools or wheel in the image (the base had {', '.join(in_base)})")

    def cli(self) -> None:
        out = self.docker("run", "--rm", "--read-only", IMAGE, "--help")
        if "serve" not in out.stdout:
            raise Failed(f"--help: no `serve` in {out.stdout[:300]!r}")
        self.ok("--help (rc 0)")
        out = self.docker("run", "--rm", "--read-only", IMAGE, "serve", check=False)
        lines = out.stderr.strip().splitlines()
        if out.returncode != 2 or len(lines) != 1 or "config" not in lines[0]:
            raise Failed(f"missing config: rc {out.returncode}, stderr {out.stderr[-600:]!r}")
        self.ok(f"missing config: rc 2, one line: {lines[0]}")

    def image_contents(self, name: str) -> None:
        uid = self.exec_py(name, "import os; print(os.getuid(), os.getgid())")
        if uid != "10001 10001":
            raise Failed(f"runs as {uid}, not 10001 10001")
        ro = self.exec_py(
            name,
            "import os\ntry:\n open('/opt/sluicegate/x', 'w')\n"
            "except OSError as e:\n print(e.errno)",
        )
        if ro != "30":  # EROFS
            raise Failed(f"root filesystem writable? ({ro!r})")
        self.ok("runs as uid/gid 10001, root filesystem read-only")
        # Everything the router imports at start has bytecode next to it (stdlib and venv): with
        # none, a read-only root compiles it all again at every start and every probe.
        # One interpreter (each costs seconds on a loaded machine): the import timed, then every
        # module it loaded checked. The cost without bytecode is a figure for docs/operations.md
        # (`docker exec -e PYTHONPYCACHEPREFIX=/nonexistent ...`), not a check.
        missing = self.exec_py(
            name,
            "import time; t = time.perf_counter(); import router.app, router.tools.probe\n"
            "took = time.perf_counter() - t\n"
            "import sys, os, importlib.util as u\n"
            "miss = [m.__name__ for m in list(sys.modules.values())"
            " if (getattr(m, '__file__', None) or '').endswith('.py')"
            " and not os.path.exists(u.cache_from_source(m.__file__))]\n"
            "print(f'{took:.2f}', len(sys.modules), miss[:10])",
        )
        took, count, miss = missing.split(" ", 2)
        if miss != "[]":
            raise Failed(f"modules without bytecode: {miss}")
        self.figures["import router.app"] = f"{took} s"
        self.ok(f"bytecode for all {count} modules the router imports (import {took} s)")

    def serve_checks(self, fast: int) -> None:
        port = free_port()
        self.start("sg-main", self.config("main", fast), "-e", f"SLUICEGATE_PORT={port}")
        took = self.healthy("sg-main")
        self.ok(f"HEALTHCHECK healthy on SLUICEGATE_PORT={port} after {took:.1f} s")
        self.image_contents("sg-main")
        for path in ("/healthz", "/readyz"):
            self.wait_http(f"http://127.0.0.1:{port}{path}", 20)
        self.ok("/healthz and /readyz answer 200")
        text, finish = self.stream(port)
        if finish is None or text.split() != [f"tok{i}" for i in range(FAST_TOKENS)]:
            raise Failed(f"stream: finish {finish!r}, text {text[:80]!r}")
        self.ok(f"streamed completion through the router ({len(text.split())} tokens)")
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=STARVED_S).text
        if "sluicegate_requests_total{" not in metrics:
            raise Failed("/metrics: no sluicegate_requests_total")
        self.ok("/metrics has the request counters")
        t0 = time.monotonic()
        self.docker("exec", "sg-main", "python", "-m", "router.tools.probe")
        self.figures["probe"] = f"{time.monotonic() - t0:.2f} s"
        self.rm("sg-main")
        # The port given on the command line instead: the probe reads it there.
        port = free_port()
        self.start("sg-port", self.config("port", fast), cmd=("serve", "--port", str(port)))
        took = self.healthy("sg-port")
        self.ok(f"HEALTHCHECK healthy on `serve --port {port}` after {took:.1f} s")
        self.rm("sg-port")

    def workers(self, fast: int) -> None:
        config = self.config("workers", fast)
        port = free_port()
        env = ["-e", f"SLUICEGATE_PORT={port}"]
        two = ("serve", "--workers", "2")
        out = self.docker(*self.run_args("sg-w-ro", config, "--rm", *env), IMAGE, *two, check=False)
        lines = out.stderr.strip().splitlines()
        if out.returncode != 2 or len(lines) != 1 or "--tmpfs /tmp" not in lines[0]:
            raise Failed(f"--workers 2, read-only /tmp: rc {out.returncode}, {out.stderr[-600:]!r}")
        self.ok(f"--workers 2 without a writable /tmp: rc 2, one line: {lines[0]}")
        self.start("sg-w", config, "--tmpfs", "/tmp", *env, cmd=two)
        self.healthy("sg-w")
        for _ in range(4):  # both workers, most likely
            text, finish = self.stream(port)
            if finish is None or len(text.split()) != FAST_TOKENS:
                raise Failed(f"--workers 2: stream finish {finish!r}")
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=STARVED_S).text
        if "sluicegate_requests_total{" not in metrics:
            raise Failed("--workers 2: /metrics has no sluicegate_requests_total")
        self.ok("--workers 2 --tmpfs /tmp: healthy, streams, /metrics")
        self.rm("sg-w")

    def stop_during_stream(self, slow: int) -> None:
        port = free_port()
        self.start(
            "sg-stop",
            self.config("stop", slow),
            "-e",
            f"SLUICEGATE_PORT={port}",
            "--stop-timeout",
            str(STOP_TIMEOUT),
        )
        self.healthy("sg-stop")
        result: dict[str, object] = {}
        begun = threading.Event()

        def client() -> None:
            try:
                result["text"], result["finish"] = self.stream(
                    port, timeout=STOP_TIMEOUT + 10, begun=begun
                )
            except Exception as exc:
                result["error"] = repr(exc)

        reader = threading.Thread(target=client)
        reader.start()
        # docker stop once the stream is under way (its first token is through): on a loaded
        # machine a fixed pause can end before the request reaches the router, which then
        # refuses it as draining.
        if not begun.wait(60):
            reader.join(STOP_TIMEOUT + 10)
            raise Failed(f"the slow stream sent no token within 60 s: {result}")
        t0 = time.monotonic()
        stopper = subprocess.Popen(
            [daemon.DOCKER, "stop", "sg-stop"],
            env=self.d.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        # /readyz turns 503 once the router has the SIGTERM, which can take a while to arrive:
        # asked until then, for as long as the stream lasts.
        readyz: int | str = "not asked"
        while reader.is_alive() and stopper.poll() is None and readyz != 503:
            try:
                readyz = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=STARVED_S).status_code
            except httpx.HTTPError as exc:
                readyz = type(exc).__name__
            time.sleep(0.2)
        stopper.wait(STOP_TIMEOUT + 20)
        stopped = time.monotonic() - t0
        reader.join(30)
        state = json.loads(self.docker("inspect", "--format", "{{json .State}}", "sg-stop").stdout)
        if "error" in result or result.get("finish") is None:
            raise Failed(f"docker stop cut the stream: {result}")
        words = str(result["text"]).split()
        if len(words) != SLOW_TOKENS:
            raise Failed(f"stream after docker stop: {len(words)} of {SLOW_TOKENS} tokens")
        if readyz != 503:
            raise Failed(f"/readyz while draining: {readyz}, never 503")
        if state.get("ExitCode") != 0 or state.get("OOMKilled"):
            raise Failed(f"after docker stop: exit {state.get('ExitCode')} (137: killed)")
        if not 10 < stopped < STOP_TIMEOUT:
            raise Failed(f"docker stop took {stopped:.1f} s (expected 10 < t < {STOP_TIMEOUT})")
        self.figures["docker stop"] = f"{stopped:.1f} s"
        self.ok(
            f"docker stop mid-stream: all {SLOW_TOKENS} tokens in {stopped:.1f} s "
            f"(> docker's default 10 s, < --stop-timeout {STOP_TIMEOUT}), /readyz 503, exit 0"
        )
        self.rm("sg-stop")

    def main(self) -> None:
        self.build()
        self.cli()
        fast = self.mock(tokens=FAST_TOKENS, itl_ms=5)
        slow = self.mock(tokens=SLOW_TOKENS, itl_ms=SLOW_ITL_MS)
        self.serve_checks(fast)
        self.workers(fast)
        self.stop_during_stream(slow)

    def stop(self) -> None:
        """Containers first (all of them are this daemon's, so all are ours), then the mocks."""
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            ids = self.docker("ps", "-aq", check=False, timeout=30).stdout.split()
            if ids:
                self.docker("rm", "-f", *ids, check=False, timeout=60)
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def lock_is_current() -> None:
    from tools.lock import BUILD_LOCK, RUNTIME_LOCK, digest, recorded

    want = digest()
    for lock in (RUNTIME_LOCK, BUILD_LOCK):
        if recorded(lock) != want:
            raise Failed(f"{lock.name} is out of date with pyproject.toml: run `make lock`")
    print("image-test: ok: the locks match pyproject.toml", flush=True)


def mem_available() -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


@contextlib.contextmanager
def workdir() -> Iterator[Path]:
    """A temporary folder for dockerd's data and the base's root: a tmpfs when the machine has
    the memory (a run leaves about 610 MB there; on a tmpfs removing it is an unmount, where on a
    busy disk deleting the layers' files took minutes), else the disk."""
    path = Path(tempfile.mkdtemp(prefix="sg-image-"))
    mounted = False
    if mem_available() > TMPFS_MIN_FREE:
        cmd = ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE},mode=0700", "sg-image", str(path)]
        mounted = subprocess.run(cmd, capture_output=True).returncode == 0
    print(f"image-test: work folder on {'a tmpfs' if mounted else 'the disk'}", flush=True)
    try:
        yield path
    finally:
        if mounted and subprocess.run(["umount", str(path)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)
        shutil.rmtree(path, ignore_errors=True)


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    # Stopped from outside (a CI timeout, Ctrl-C, even when started in the background with
    # SIGINT ignored): unwind, so the cleanup below still stops dockerd and removes its data.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    t_start = time.monotonic()
    try:
        lock_is_current()
        daemon.ensure_tools()
    except (Failed, subprocess.CalledProcessError) as exc:
        print(f"image-test: FAILED: {exc}", flush=True)
        return 1
    with workdir() as work:
        d = daemon.Daemon(work)
        why = d.start()
        if why is not None:
            d.stop()
            print(f"image-test: SKIPPED, not passed: dockerd cannot start here ({why})", flush=True)
            return 0
        run = Run(work, d)
        run.passed.append("the locks match pyproject.toml")
        failed = 0
        try:
            run.main()
        except (
            Failed,
            subprocess.CalledProcessError,
            subprocess.TimeoutExpired,
            RuntimeError,
        ) as exc:
            print(f"image-test: FAILED ({time.monotonic() - T0:.0f} s): {exc}", flush=True)
            failed = 1
        finally:
            used = shutil.disk_usage(work).used if os.path.ismount(work) else 0
            run.stop()
            d.stop()
        if used:
            run.figures["tmpfs used"] = f"{used / 1e6:.0f} MB"
    figures = ", ".join(f"{k} {v}" for k, v in run.figures.items())
    print(f"image-test: {time.monotonic() - t_start:.0f} s in all; {figures}", flush=True)
    print(f"image-test: {len(run.passed)} passed, {failed} failed", flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())
