"""The fake Kubernetes API server (tests/support/fake_kube.py) in a process of its own, for
benchmarks that measure a router in the benchmark's process: the fake's JSON work must not take the
GIL from the router being timed.

    python -m bench.oneoff.kube_proc PORT
    then one JSON command per stdin line, "ok" per line back:
        {"op": "fill", "slices": 50, "per_slice": 1000, "port": 9}   slices s0..s49 of loopback
                                                                     addresses (127.x.y.z)
        {"op": "put", "slice": 3, "ranges": [[3000, 1000], [90000, 1]], "port": 9}
        {"op": "delete", "slice": 3}
"""

from __future__ import annotations

import json
import sys
from typing import Any

from tests.support.fake_kube import FakeKube, endpoint


def address(i: int) -> str:
    """The i-th loopback address from 127.1.0.0 (nothing listens there: dials fail at once)."""
    return f"127.{1 + i // 65536}.{i // 256 % 256}.{i % 256}"


def endpoints(first: int, count: int) -> list[dict[str, Any]]:
    return [endpoint(address(i)) for i in range(first, first + count)]


def main() -> None:
    kube = FakeKube(int(sys.argv[1]), bookmark_every=30.0)
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            ports = [{"name": "http", "port": cmd.get("port", 9)}]
            if cmd["op"] == "fill":
                n = cmd["per_slice"]
                for s in range(cmd["slices"]):
                    kube.put_slice(f"s{s}", endpoints(s * n, n), ports)
            elif cmd["op"] == "put":
                eps = [e for first, count in cmd["ranges"] for e in endpoints(first, count)]
                kube.put_slice(f"s{cmd['slice']}", eps, ports)
            elif cmd["op"] == "delete":
                kube.delete_slice(f"s{cmd['slice']}")
            print("ok", flush=True)
    finally:
        kube.close()


if __name__ == "__main__":
    main()
