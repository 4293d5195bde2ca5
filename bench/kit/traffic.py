"""Keyed traffic against a router with an admission queue: keep-alive clients that keep each
answer's status, time to first byte and `Retry-After`, in open or closed loops, in this process or
in a child process of its own (`flood`, `python -m bench.kit.traffic SPEC`). The `noisy` and
`admission` scenarios' loads.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from bench.kit import loadgen
from bench.kit.cluster import CHAT, ROOT

LENGTHS = range(10, 51)  # output tokens per request: uniform, mean 30 (0.3 s at 10 ms a token)


def bodies(lengths: range = LENGTHS) -> list[bytes]:
    """One pre-built streaming body per output length."""
    return [
        json.dumps(
            {
                "model": "m",
                "stream": True,
                "max_tokens": n,
                "messages": [{"role": "user", "content": "hello"}],
            }
        ).encode()
        for n in lengths
    ]


class _Conn(loadgen._Conn):
    """The load generator's connection, keeping the response head (for `Retry-After`) and
    telling a lost connection from a refused request."""

    def __init__(self) -> None:
        super().__init__()
        self.head = b""
        self.lost = False

    def start(self, request: bytes) -> asyncio.Future[bool]:
        self.head = b""
        return super().start(request)

    def data_received(self, data: bytes) -> None:
        if not self.in_body and not self.head:
            seen = bytes(self.buf) + data
            end = seen.find(b"\r\n\r\n")
            if end >= 0:
                self.head = seen[:end].lower()
        super().data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        super().connection_lost(exc)


@dataclass(slots=True)
class Outcome:
    status: int  # 0: no answer (connection failed or the client gave up: a hang)
    first: float  # seconds to the first body byte (the first token of a stream)
    total: float  # seconds to the end of the response
    retry_after: bool
    sent: float = 0.0  # perf_counter when it was sent


@dataclass
class Traffic:
    outcomes: list[Outcome] = field(default_factory=list)
    cpu_s: float = 0.0
    lag_max_s: float = 0.0  # this generator's own worst event-loop stall (a busy machine's)


async def _lag(out: Traffic, stop: asyncio.Event) -> None:
    """Record how late a 10 ms sleep wakes: a stall here delays every timing this loop takes."""
    while not stop.is_set():
        t0 = time.perf_counter()
        await asyncio.sleep(0.01)
        out.lag_max_s = max(out.lag_max_s, time.perf_counter() - t0 - 0.01)


class Client:
    """Keep-alive connections to one router, reused across requests (one request each at a
    time), opened on demand."""

    def __init__(self, host: str, port: int, headers: str, timeout: float) -> None:
        if not ipaddress.ip_address(host).is_loopback:
            raise ValueError("benchmark traffic only targets loopback addresses")
        self.host, self.port, self.headers, self.timeout = host, port, headers, timeout
        self.idle: list[_Conn] = []
        self.open: set[_Conn] = set()

    async def send(self, body: bytes) -> Outcome:
        loop = asyncio.get_running_loop()
        conn = self.idle.pop() if self.idle else None
        if conn is None or conn.lost:
            try:
                _, conn = await loop.create_connection(_Conn, self.host, self.port)
            except OSError:
                return Outcome(0, 0.0, 0.0, False)
            self.open.add(conn)
        req = loadgen.build_request(self.host, self.port, CHAT, body, self.headers)
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(conn.start(req), self.timeout)
        except TimeoutError:
            pass
        t1 = time.perf_counter()
        done = not conn.lost and conn.done is not None and conn.done.done()
        if not done:  # lost or timed out: this connection is finished either way
            assert conn.transport is not None
            conn.transport.close()
            self.open.discard(conn)
            return Outcome(0, 0.0, t1 - t0, False)
        self.idle.append(conn)
        first = conn.first - t0 if conn.first else t1 - t0
        return Outcome(conn.status, first, t1 - t0, b"\r\nretry-after:" in conn.head, t0)

    def close(self) -> None:
        for conn in self.open:
            if conn.transport is not None:
                conn.transport.close()
        self.open.clear()
        self.idle.clear()


async def open_loop(
    port: int,
    rate: float,
    seconds: float,
    headers: str,
    give_up: float,
    seed: int,
    lengths: range = LENGTHS,
    steady: bool = False,
) -> Traffic:
    """Poisson arrivals (evenly spaced if `steady`) at `rate` per second for `seconds`; each
    request's output length drawn
    from `LENGTHS`. Waits for every request (each bounded by `give_up` seconds)."""
    rng = random.Random(seed)
    pool = bodies(lengths)
    client = Client("127.0.0.1", port, headers, give_up)
    out = Traffic()
    stop = asyncio.Event()
    lag = asyncio.ensure_future(_lag(out, stop))
    tasks: list[asyncio.Task[Outcome]] = []
    t0 = time.perf_counter()
    c0 = time.process_time()
    due = t0
    while True:
        due += 1 / rate if steady else rng.expovariate(rate)
        if due - t0 > seconds:
            break
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(client.send(rng.choice(pool))))
    out.outcomes = list(await asyncio.gather(*tasks))
    out.cpu_s = time.process_time() - c0
    stop.set()
    await lag
    client.close()
    return out


async def closed_loop(
    port: int,
    users: int,
    seconds: float,
    headers: str,
    give_up: float,
    seed: int,
    lengths: range = LENGTHS,
) -> Traffic:
    """`users` clients, each sending its next request when the last one ends."""
    rng = random.Random(seed)
    pool = bodies(lengths)
    client = Client("127.0.0.1", port, headers, give_up)
    out = Traffic()
    stop = time.perf_counter() + seconds
    c0 = time.process_time()
    done = asyncio.Event()
    lag = asyncio.ensure_future(_lag(out, done))

    async def user() -> None:
        while time.perf_counter() < stop:
            res = await client.send(rng.choice(pool))
            out.outcomes.append(res)
            if res.status == 0:
                await asyncio.sleep(0.05)

    await asyncio.gather(*(user() for _ in range(users)))
    out.cpu_s = time.process_time() - c0
    done.set()
    await lag
    client.close()
    return out


def summary(t: Traffic) -> dict[str, Any]:
    """Counts by status, refusals without `Retry-After`, and the slowest answer per status."""
    by_status: dict[str, int] = {}
    slowest: dict[str, float] = {}
    missing = 0
    for o in t.outcomes:
        s = str(o.status)
        by_status[s] = by_status.get(s, 0) + 1
        # A served stream's answer is its first byte; a refusal's is the whole (small) body.
        took = o.first if o.status == 200 else o.total
        slowest[s] = max(slowest.get(s, 0.0), took)
        if o.status in (429, 503) and not o.retry_after:
            missing += 1
    return {
        "requests": len(t.outcomes),
        "status": by_status,
        "slowest_answer_s": {k: round(v, 3) for k, v in slowest.items()},
        "refusals_without_retry_after": missing,
        "loadgen_cpu_s": round(t.cpu_s, 2),
        "loadgen_lag_max_s": round(t.lag_max_s, 3),
    }


def flood(spec: dict[str, Any]) -> subprocess.Popen[str]:
    """Start a load in a child process (its own event loop and core share): `port`, `secret`,
    `seconds`, `lengths` ([lo, hi)), `give_up` (seconds a client waits for an answer: later is a
    hang), and `rate` (open loop) or `users` (closed loop). Its `summary` comes back as JSON on
    stdout."""
    args = [sys.executable, "-m", "bench.kit.traffic", json.dumps(spec)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, text=True, cwd=ROOT)


def collect(load: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    """The child load's summary; a child past `timeout` is killed (by its own id), not left."""
    try:
        out, _ = load.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        load.kill()
        load.wait(5)
        raise
    summary: dict[str, Any] = json.loads(out)
    return summary


def durations(port: int, auth: str, lengths: range = LENGTHS) -> list[float]:
    """Request durations on the idle fleet, one request at a time, every other length of
    `lengths` once, shuffled: the mean over slots is the turnover."""

    async def go() -> list[float]:
        client = Client("127.0.0.1", port, auth, 30)
        order = bodies(lengths)[:: 2 if len(lengths) > 8 else 1]
        random.Random(7).shuffle(order)
        took = []
        for body in order:
            o = await client.send(body)
            if o.status == 200:
                took.append(o.total)
        client.close()
        return took

    return asyncio.run(go())


def _flood_main(raw: str) -> None:
    import uvloop

    spec = json.loads(raw)
    auth = f"authorization: Bearer {spec['secret']}\r\n"
    lengths = range(*spec["lengths"])
    give_up = spec["give_up"]
    load = (
        open_loop(spec["port"], spec["rate"], spec["seconds"], auth, give_up, 3, lengths)
        if "rate" in spec
        else closed_loop(spec["port"], spec["users"], spec["seconds"], auth, give_up, 3, lengths)
    )
    print(json.dumps(summary(uvloop.run(load))), flush=True)


if __name__ == "__main__":
    _flood_main(sys.argv[1])
