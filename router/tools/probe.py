"""`python -m router.tools.probe`: the image's HEALTHCHECK (exit 0 when /healthz answers 200).

It asks the address the router was started on: `--host`/`--port` from the container's main
command line (PID 1, or the process a `docker run --init` shim started), else SLUICEGATE_HOST /
SLUICEGATE_PORT, else 127.0.0.1:8080; a wildcard host is probed on loopback. Standard library
only, so a probe costs an interpreter start and one request, not the router's imports.
"""

from __future__ import annotations

import os
import sys
import urllib.request
from collections.abc import Mapping, Sequence

_WILDCARD = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "::1"}


def _flag(argv: Sequence[str], name: str) -> str | None:
    """The last value of `--name V` or `--name=V` in argv (argparse keeps the last one too)."""
    found = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith(name + "="):
            found = arg[len(name) + 1 :]
    return found


def target(argv: Sequence[str], env: Mapping[str, str]) -> str:
    """The /healthz URL of a router started with `argv` in environment `env`."""
    host = _flag(argv, "--host") or env.get("SLUICEGATE_HOST", "127.0.0.1")
    port = _flag(argv, "--port") or env.get("SLUICEGATE_PORT", "8080")
    host = _WILDCARD.get(host, host).strip("[]")
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{int(port)}/healthz"


def _main_argv() -> list[str]:
    try:
        with open("/proc/1/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def main() -> int:
    url = "(no address)"
    try:
        url = target(_main_argv(), os.environ)
        with urllib.request.urlopen(url, timeout=2) as resp:
            return 0 if resp.status == 200 else 1
    except (OSError, ValueError) as exc:
        print(f"sluicegate probe: {url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
