"""Router memory under request-body floods: bodies that stop short, and big queued bodies.

    python -m bench.oneoff.bodies            # ~30 s: RSS before, at the peak and after each flood

1. `short`: connections each send a request head and all but 1 KB of a 4 MB body, then go
   silent. `server.body_timeout` (2 s here) answers each 408 and closes it.
2. `queue`: the only backend slot is held by a request that never ends; 200 requests with 4 MB
   bodies queue behind it. `admission.max_queue_bytes` (256 MiB) sheds what does not fit
   (503 queue_full), the rest wait holding their raw body once; then the clients leave.

Each flood reports the router's RSS before it, at its peak and after it (the target: back
within 10 % of before).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from typing import Any

import httpx

from bench.kit.procstat import rss_mb
from tests.support.harness import Cluster, Proc, backend, control

MB = 1024 * 1024
ENV: dict[str, str] = {}


def _body(size: int) -> bytes:
    head = b'{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"'
    tail = b'"}]}'
    return head + b"x" * (size - len(head) - len(tail)) + tail


def _head(length: int) -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % length
    )


async def _client(port: int, data: bytes, hold: float) -> bytes:
    """Send `data`, read what comes within `hold` seconds, then leave."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    got = b""
    try:
        writer.write(data)
        await writer.drain()
        end = time.monotonic() + hold
        while (left := end - time.monotonic()) > 0:
            try:
                chunk = await asyncio.wait_for(reader.read(65536), left)
            except TimeoutError:
                break
            if not chunk:
                break
            got += chunk
    except ConnectionError:  # answered (408, 503) and closed before the body was all sent
        pass
    finally:
        writer.close()
    return got


class Peak:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = rss_mb(pid)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, rss_mb(self.pid))
            time.sleep(0.05)

    def stop(self) -> float:
        self._done.set()
        self._thread.join(5)
        return self.peak


def _status(reply: bytes) -> str:
    return reply.split(b" ", 2)[1].decode() if reply.startswith(b"HTTP/1.1 ") else "none"


def _counts(replies: list[bytes]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in replies:
        out[_status(r)] = out.get(_status(r), 0) + 1
    return out


def _settle(pid: int, target: float, within: float) -> float:
    """RSS once it is back near `target`, or after `within` seconds."""
    end = time.monotonic() + within
    now = rss_mb(pid)
    while now > target * 1.05 and time.monotonic() < end:
        time.sleep(0.25)
        now = rss_mb(pid)
    return now


def _router(cluster: Cluster, mock: Proc, body_timeout: float) -> Proc:
    return cluster.router(
        {
            "backends": [backend("b", mock, max_inflight=1)],
            "server": {"body_timeout": body_timeout},
            "admission": {"max_wait": 30},
            "max_body_bytes": 8 * MB,
            "health": {"interval": 60},
        },
        env={"SLUICEGATE_LOG_LEVEL": "warning", **ENV},
    )


def _warm(router: Proc, body: bytes) -> None:
    with httpx.Client(timeout=30) as http:  # the path, the pools, one big body
        for _ in range(3):
            http.post(router.url + "/v1/chat/completions", content=body).raise_for_status()


def run(cluster: Cluster, connections: int = 100, queued: int = 200) -> dict[str, Any]:
    mock = cluster.mock("bodies", tokens=1)
    router = _router(cluster, mock, 2.0)
    body = _body(4 * MB)
    _warm(router, body)
    out: dict[str, Any] = {}

    # 1. bodies that stop 1 KB short
    before = rss_mb(router.pid)
    peak = Peak(router.pid)
    short = _head(len(body)) + body[:-1024]
    started = time.monotonic()

    async def shorts() -> list[bytes]:
        return list(
            await asyncio.gather(*(_client(router.port, short, 6.0) for _ in range(connections)))
        )

    replies = asyncio.run(shorts())
    top = peak.stop()
    out["short"] = {
        "connections": connections,
        "answers": _counts(replies),
        "seconds": round(time.monotonic() - started, 2),
        "rss_mb_before": round(before, 1),
        "rss_mb_peak": round(top, 1),
        "rss_mb_after": round(_settle(router.pid, before, 12), 1),
    }
    print("short: " + json.dumps(out["short"]), flush=True)

    # 2. big bodies queued behind a slot that never frees (bodies sent 20 at a time: this
    # machine's client sends ~100 MB/s, and the default body_timeout, 30 s, must not cut them)
    router.stop()
    router = _router(cluster, mock, 30.0)
    _warm(router, body)
    control(mock, hang=True)
    before = rss_mb(router.pid)
    peak = Peak(router.pid)
    started = time.monotonic()

    async def queue() -> tuple[list[bytes], int]:
        holder = asyncio.create_task(_client(router.port, _head(len(body)) + body, 25.0))
        await asyncio.sleep(0.5)
        flood = []
        for i in range(queued):
            flood.append(
                asyncio.create_task(_client(router.port, _head(len(body)) + body, 20.0 - i * 0.05))
            )
            if i % 20 == 19:
                await asyncio.sleep(0.5)
        await asyncio.sleep(4.0)
        async with httpx.AsyncClient(timeout=5) as http:
            text = (await http.get(router.url + "/metrics")).text
        depth = sum(
            int(float(line.rsplit(" ", 1)[1]))
            for line in text.splitlines()
            if line.startswith("sluicegate_queue_depth{")
        )
        replies = list(await asyncio.gather(*flood))
        holder.cancel()
        return replies, depth

    replies, depth = asyncio.run(queue())
    control(mock, hang=False)
    top = peak.stop()
    out["queue"] = {
        "requests": queued,
        "answers": _counts(replies),
        "queued_at_peak": depth,
        "seconds": round(time.monotonic() - started, 2),
        "rss_mb_before": round(before, 1),
        "rss_mb_peak": round(top, 1),
        "rss_mb_after": round(_settle(router.pid, before, 12), 1),
    }
    print("queue: " + json.dumps(out["queue"]), flush=True)
    router.stop()
    mock.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--connections", type=int, default=100)
    ap.add_argument("--queued", type=int, default=200)
    args = ap.parse_args()
    cluster = Cluster()
    try:
        run(cluster, args.connections, args.queued)
    finally:
        cluster.close()


if __name__ == "__main__":
    main()
