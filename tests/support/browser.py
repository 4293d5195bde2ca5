"""A real headless Chromium driven over the Chrome DevTools Protocol, for the console's tests.

The distribution's Chromium (`make test` installs it), started with a fresh profile and with
every background connection it would make off (the machine's network is closed; Chromium's
own update, sync and field-trial fetches would only wait and fail). The protocol runs over the
`websockets` package that uvicorn[standard] already brings: a few commands (navigate, evaluate,
screenshot) need no driver process of their own and no browser build pinned to a driver.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from websockets.sync.client import connect

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-dev-shm-usage",
    "--remote-debugging-address=127.0.0.1",
    "--remote-debugging-port=0",
)


def chromium_path() -> str | None:
    return os.environ.get("SLUICEGATE_CHROMIUM") or shutil.which("chromium")


class BrowserError(Exception):
    pass


class Browser:
    """One Chromium process with one tab; `close()` stops the process it started."""

    def __init__(self, binary: str, tmp: Path, width: int = 1440, height: int = 900) -> None:
        profile = tmp / "chromium-profile"
        profile.mkdir(parents=True, exist_ok=True)
        self._log = open(tmp / "chromium.log", "w+b")  # closed in close()
        self._proc = subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=self._log,
            stdin=subprocess.DEVNULL,
            # A group of its own: close() stops its renderers and helpers too (killing the main
            # process alone left them behind when it had to be killed).
            process_group=0,
        )
        self.events: list[dict[str, Any]] = []
        self._ids = itertools.count(1)
        self._stack = contextlib.ExitStack()
        try:
            self._ws = self._stack.enter_context(
                connect(self._devtools_url(), max_size=64 * 1024 * 1024, open_timeout=10)
            )
            target = self._call("Target.createTarget", {"url": "about:blank"})["targetId"]
            self._session = self._call(
                "Target.attachToTarget", {"targetId": target, "flatten": True}
            )["sessionId"]
            for domain in ("Page", "Runtime", "Log"):
                self.call(f"{domain}.enable")
            self.call(
                "Emulation.setDeviceMetricsOverride",
                {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
            )
        except Exception:
            self.close()
            raise

    def _devtools_url(self, within: float = 20.0) -> str:
        end = time.monotonic() + within
        while time.monotonic() < end:
            if self._proc.poll() is not None:
                raise BrowserError(f"chromium exited with {self._proc.returncode}: {self.log()}")
            printed = Path(self._log.name).read_bytes()
            found = re.search(rb"DevTools listening on (ws://\S+)", printed)
            if found:
                return found.group(1).decode()
            time.sleep(0.05)
        raise BrowserError(f"chromium did not open its DevTools port in {within}s: {self.log()}")

    def log(self) -> str:
        return Path(self._log.name).read_bytes()[-4000:].decode(errors="replace")

    def _call(
        self, method: str, params: dict[str, Any] | None = None, session: str | None = None
    ) -> dict[str, Any]:
        msg_id = next(self._ids)
        message: dict[str, Any] = {"id": msg_id, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        self._ws.send(json.dumps(message))
        end = time.monotonic() + 30
        while True:
            raw = self._ws.recv(timeout=max(0.1, end - time.monotonic()))
            answer = json.loads(raw)
            if answer.get("id") == msg_id:
                if "error" in answer:
                    raise BrowserError(f"{method}: {answer['error']}")
                return dict(answer.get("result", {}))
            if "method" in answer:
                self.events.append(answer)
                del self.events[:-500]  # bounded: the tests read only recent ones

    def call(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        return self._call(method, params, self._session)

    def evaluate(self, expression: str) -> Any:
        result = self.call(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
        )
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression!r}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def goto(self, url: str) -> None:
        self.call("Page.navigate", {"url": url})
        self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'")

    def wait_for(self, expression: str, within: float = 15.0) -> Any:
        """The expression's first truthy value, evaluated every 50 ms for `within` seconds.

        The default only bounds a page that never gets there: a page's state is asserted, not
        its speed (a test that promises a time passes its own `within`). 5 s ran out beside a
        full suite and two busy loops on 2 cores."""
        end = time.monotonic() + within
        value: Any = None
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > end:
                raise BrowserError(f"{expression!r} still {value!r} after {within}s")
            time.sleep(0.05)

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
        path.write_bytes(base64.b64decode(data["data"]))
        return path

    def problems(self) -> list[str]:
        """Script exceptions and console errors (a CSP violation is one) seen so far; answers
        with an error status (a 401 before the token is typed) are the page's to show, not
        problems."""
        out = []
        for e in self.events:
            if e["method"] == "Runtime.exceptionThrown":
                out.append(str(e["params"]["exceptionDetails"]))
            elif e["method"] == "Log.entryAdded":
                entry = e["params"]["entry"]
                if entry["level"] == "error" and entry.get("source") != "network":
                    out.append(f"{entry.get('source')}: {entry.get('text')}")
        return out

    def close(self) -> None:
        if hasattr(self, "_ws"):
            try:
                self._call("Browser.close")
            except Exception:  # closing: the browser may already be gone
                pass
        self._stack.close()
        if self._proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self._proc.wait(5)
        self._signal_group(signal.SIGKILL)  # whatever of its group outlived it
        self._log.close()

    def _signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, sig)
