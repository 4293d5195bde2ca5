"""Router memory under request-body floods: bodies that stop short, big queued bodies, uploads.

    python -m bench.oneoff.bodies            # ~40 s: RSS before, at the peak and after each flood
    python -m bench.oneoff.bodies --uploads  # ~15 s: the uploads part alone

1. `short`: connections each send a request head and all but 1 KB of a 4 MB body, then go
   silent. `server.body_timeout` (2 s here) answers each 408 and closes it.
2. `queue`: the only backend slot is held by a request that never ends; 200 requests with 4 MB
   bodies queue behind it. `admission.max_queue_bytes` (256 MiB) sheds what does not fit
   (503 queue_full), the rest wait holding their raw body once; then the clients leave.

3. `uploads` (issue 46, cases 1 and 10): one upload whose part header repeats
   `content-disposition:;` on one line for 252 KB (the multipart scan was quadratic: 13 s of a
   frozen worker), timed beside `/healthz` asked at the same moment (the loop's stall); then
   UPLOADS uploads of 24 MB at once against the body budget (`max_held_body_bytes`, 256 MiB):
   answers, and the router's RSS.

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


UPLOADS = 20
BOUNDARY = b"bench-boundary"


def _form(parts: list[tuple[bytes, bytes]]) -> bytes:
    """A multipart body of (part header, content) pairs."""
    out = b""
    for header, content in parts:
        out += b"--" + BOUNDARY + b"\r\n" + header + b"\r\n\r\n" + content + b"\r\n"
    return out + b"--" + BOUNDARY + b"--\r\n"


def _upload(body: bytes) -> bytes:
    return (
        b"POST /v1/audio/transcriptions HTTP/1.1\r\nhost: x\r\n"
        b"content-type: multipart/form-data; boundary=" + BOUNDARY + b"\r\n"
        b"content-length: %d\r\n\r\n" % len(body)
    ) + body


def uploads(cluster: Cluster) -> dict[str, Any]:
    mock = cluster.mock("uploads", tokens=1)
    router = cluster.router(
        {"backends": [backend("b", mock)], "health": {"interval": 60}},
        env={"SLUICEGATE_LOG_LEVEL": "warning", **ENV},
    )
    model = b'content-disposition: form-data; name="model"'
    hostile = _form([(b"content-disposition:;" * (252 * 1024 // 21), b"m"), (model, b"m")])

    async def header_flood() -> dict[str, Any]:
        async def healthz() -> float:
            async with httpx.AsyncClient(timeout=60) as http:
                t0 = time.monotonic()
                (await http.get(router.url + "/healthz")).raise_for_status()
                return time.monotonic() - t0

        async def post() -> tuple[int, float]:
            async with httpx.AsyncClient(timeout=60) as http:
                t0 = time.monotonic()
                r = await http.post(
                    router.url + "/v1/audio/transcriptions",
                    content=hostile,
                    headers={"content-type": "multipart/form-data; boundary=bench-boundary"},
                )
                return r.status_code, time.monotonic() - t0

        sent = asyncio.create_task(post())
        await asyncio.sleep(0.05)  # the upload's bytes first, then the unrelated request
        beside = await healthz()
        status, took = await sent
        return {
            "header_kb": len(hostile) // 1024,
            "answer": status,
            "seconds_to_answer": round(took, 3),
            "healthz_beside_s": round(beside, 3),
        }

    out: dict[str, Any] = {"header": asyncio.run(header_flood())}
    print("uploads header: " + json.dumps(out["header"]), flush=True)

    audio = b"\0" * (24 * MB)
    body = _form(
        [(model, b"m"), (b'content-disposition: form-data; name="file"; filename="a.wav"', audio)]
    )
    before = rss_mb(router.pid)
    peak = Peak(router.pid)

    async def flood() -> list[bytes]:
        data = _upload(body)
        return list(
            await asyncio.gather(*(_client(router.port, data, 30.0) for _ in range(UPLOADS)))
        )

    replies = asyncio.run(flood())
    top = peak.stop()
    out["flood"] = {
        "uploads": UPLOADS,
        "mb_each": 24,
        "answers": _counts(replies),
        "rss_mb_before": round(before, 1),
        "rss_mb_peak": round(top, 1),
        "rss_mb_after": round(_settle(router.pid, before, 12), 1),
    }
    print("uploads flood: " + json.dumps(out["flood"]), flush=True)
    router.stop()
    mock.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--connections", type=int, default=100)
    ap.add_argument("--queued", type=int, default=200)
    ap.add_argument("--uploads", action="store_true", help="only the uploads part")
    args = ap.parse_args()
    cluster = Cluster()
    try:
        if not args.uploads:
            run(cluster, args.connections, args.queued)
        uploads(cluster)
    finally:
        cluster.close()


if __name__ == "__main__":
    main()
