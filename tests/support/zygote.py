"""Routers and mock engines forked from one process that has already imported them.

A router process spends ~1.5 s of CPU importing FastAPI, pydantic and the project before it
serves; the suite starts ~200 routers and ~220 mocks, so imports were about a third of its CPU
on two cores. The zygote imports them once per test process, then forks on request: each child is
a real, separate process that runs `router.cli.main(argv)` with the test's environment, working
directory and log file, and exits through the interpreter's normal shutdown (threads joined,
atexit run), as `python -m router.cli` does.

Only what an import cannot have baked in is forked (`forkable`): one worker (several use
multiprocessing's spawn, which re-imports `__main__`), the project's own tree on the path, and
no environment variable read at import time. The rest, and every run with
SLUICEGATE_TEST_FORK=0, starts with `subprocess.Popen` as before.

Protocol, one JSON line each way on the zygote's stdin and stdout: a request
{"argv", "env", "cwd", "log"} is answered {"pid"}. The zygote reaps its children and writes each
one's exit status (Popen's convention: -N for a signal) to `<log>.exit`, which `Forked` reads.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

# Read when a module is imported, so a child would keep the zygote's value: never forked.
IMPORT_TIME_ENV = ("PROMETHEUS_MULTIPROC_DIR", "PYTHONPATH", "PYTHONHASHSEED", "PYTHONWARNINGS")
COMMANDS = ("serve", "mock-upstream")


def forkable(args: list[str], env: dict[str, str], cwd: Path | str) -> bool:
    if os.environ.get("SLUICEGATE_TEST_FORK", "1") == "0":
        return False
    if args[:3] != [sys.executable, "-m", "router.cli"] or len(args) < 4:
        return False
    if args[3] not in COMMANDS or Path(cwd).resolve() != ROOT:
        return False
    if "--workers" in args and args[args.index("--workers") + 1] != "1":
        return False
    return not any(env.get(k) != os.environ.get(k) for k in IMPORT_TIME_ENV)


class Forked:
    """The part of `subprocess.Popen` the tests use, for a child of the zygote."""

    def __init__(self, pid: int, log: Path) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.log_path = log
        self._exit = Path(str(log) + ".exit")

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = int(self._exit.read_text())
            except (OSError, ValueError):
                return None
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(["router.cli", str(self.pid)], timeout or 0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(15)

    def kill(self) -> None:
        self.send_signal(9)


class Zygote:
    """One per test process, started on first use; `spawn` returns None when it cannot fork."""

    _lock = threading.Lock()
    _proc: subprocess.Popen[bytes] | None = None
    _broken = False

    @classmethod
    def spawn(
        cls, args: list[str], env: dict[str, str], cwd: Path | str, log: Path
    ) -> Forked | None:
        with cls._lock:
            if cls._broken:
                return None
            try:
                if cls._proc is None or cls._proc.poll() is not None:
                    cls._proc = subprocess.Popen(
                        [sys.executable, "-m", "tests.support.zygote"],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        cwd=ROOT,
                        env={**os.environ, "PYTHONUNBUFFERED": "1"},
                    )
                assert cls._proc.stdin is not None and cls._proc.stdout is not None
                # A restart on the same port writes the same log: not its predecessor's status.
                Path(str(log) + ".exit").unlink(missing_ok=True)
                request = {"argv": args[3:], "env": env, "cwd": str(cwd), "log": str(log)}
                cls._proc.stdin.write(json.dumps(request).encode() + b"\n")
                cls._proc.stdin.flush()
                line = cls._proc.stdout.readline()
                pid = int(json.loads(line)["pid"])
            except (OSError, ValueError, KeyError):
                # A zygote that cannot fork (or died) costs the suite speed, not correctness.
                cls._broken = True
                return None
            return Forked(pid, log)


def _preload() -> None:
    import httptools  # noqa: F401
    import uvicorn  # noqa: F401
    import uvloop  # noqa: F401

    import router.app
    import router.cli
    import router.ops.logs
    import router.tools.mock.engine
    import router.tools.mock.handoff
    import router.tools.mock.upstream
    import router.web.edge  # noqa: F401


def _status(raw: int) -> int:
    return -os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)


def _reap(logs: dict[int, str]) -> None:
    while logs:
        try:
            pid, raw = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        log = logs.pop(pid, None)
        if log is not None:
            tmp = log + ".exit.tmp"
            with open(tmp, "w") as fh:
                fh.write(str(_status(raw)))
            os.replace(tmp, log + ".exit")


def _serve() -> dict[str, Any] | None:
    """The zygote's loop; returns only in a child, with the request it is to run."""
    logs: dict[int, str] = {}
    pending = b""
    while True:
        ready, _, _ = select.select([0], [], [], 0.02)
        _reap(logs)
        if not ready:
            continue
        chunk = os.read(0, 65536)
        if not chunk:  # the test process is gone
            return None
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            if threading.active_count() != 1:
                raise RuntimeError("a thread started in the zygote: forking it is unsafe")
            pid = os.fork()
            if pid == 0:
                return dict(request)
            logs[pid] = request["log"]
            os.write(1, json.dumps({"pid": pid}).encode() + b"\n")


def _become(request: dict[str, Any]) -> None:
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [str(ROOT / "router" / "cli.py"), *request["argv"]]


def main() -> int:
    _preload()
    request = _serve()
    if request is None:
        return 0
    _become(request)
    from router.cli import main as cli

    return cli(request["argv"])


if __name__ == "__main__":
    sys.exit(main())
