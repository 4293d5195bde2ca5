"""Redis commands from concurrent requests, sent together: one pipeline in flight at a time.

A burst of 200 requests would otherwise queue for a handful of pooled connections, one round trip
each, and blow a timeout of tens of ms; pipelined, they cost a round trip or two between them.
Each command is still its own atomic unit (a script runs whole), and each caller waits for one
round trip at most behind the batch on the wire. Commands are packed here (RESP arrays of bulk
strings) and written on one connection in one go: redis-py's generic pipeline machinery cost
several times more CPU per command on the router's hot path. Every key a batch names shares one
hash tag, so the whole pipeline goes to one server: `KeyConnections` finds it (the Sentinel
master, the Cluster primary owning the slot; `HeldConnection` keeps one to it).

Each round trip is reported to its store: a failure (no answer in time, a lost connection), a
redirect (MOVED, ASK) or CLUSTERDOWN (the slot map is then read again), or an error reply that
speaks for the server rather than the command (OOM, READONLY, LOADING, BUSY, ...: Redis answered
but is not taking the store's work) is a failed round trip. A script's own runtime error is its
request's, and NOSCRIPT is answered here by loading the scripts and sending those commands again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.connection import Connection
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.exceptions import (
    AskError,
    ClusterDownError,
    NoScriptError,
    ResponseError,
    TryAgainError,
)

from router.core.errors import STORE_FAILURES
from router.core.redis_client import KeyConnections, off_master

MAX_BATCH = 512

# Replies that say the slot is served elsewhere (MovedError is an AskError) or not at all yet.
_MOVED = (AskError, ClusterDownError, TryAgainError)

# A caller awaiting the reply, or a callback told of failure for a fire-and-forget command.
Waiter = asyncio.Future[Any] | Callable[[], None]
# Told of each round trip: None when Redis took it, else what went wrong.
OnRoundTrip = Callable[[BaseException | None], None]


def pack(args: tuple[Any, ...]) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        parts.append(b"$%d\r\n%b\r\n" % (len(b), b))
    return b"".join(parts)


def script_failed(exc: BaseException) -> bool:
    """A runtime error inside a script names it ("... script: <sha>, on @user_script:107."); a
    busy, loading, read-only or out-of-memory server answers with its own code and no name."""
    return type(exc) is ResponseError and "user_script" in str(exc)


def _refused(reply: Any) -> bool:
    """An error reply that is the server's state, not the command's fault."""
    return (
        isinstance(reply, ResponseError)
        and not isinstance(reply, NoScriptError)
        and not script_failed(reply)
    )


class Batcher:
    def __init__(
        self,
        conns: KeyConnections,
        scripts: dict[str, str],
        timeout: float,
        on_round_trip: OnRoundTrip,
    ) -> None:
        self._conns = conns
        self._scripts = scripts  # sha -> source, reloaded when Redis answers NOSCRIPT
        self._timeout = timeout
        self._on_round_trip = on_round_trip
        self._pending: list[tuple[tuple[Any, ...], Waiter]] = []
        self._flusher: asyncio.Task[None] | None = None

    async def call(self, *command: Any) -> Any:
        """The command's reply; raises what Redis (or the wire) raised for it."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._enqueue(command, fut)
        return await fut

    def post(self, command: tuple[Any, ...], on_failure: Callable[[], None]) -> None:
        """Send without waiting for the reply (a release); `on_failure` runs if it is lost."""
        self._enqueue(command, on_failure)

    def _enqueue(self, command: tuple[Any, ...], waiter: Waiter) -> None:
        self._pending.append((command, waiter))
        if self._flusher is None:
            self._flusher = asyncio.get_running_loop().create_task(self._flush())

    async def drain(self, within: float) -> None:
        """Wait (bounded) until everything queued so far has been sent and answered."""
        end = asyncio.get_running_loop().time() + within
        while self._flusher is not None:
            left = end - asyncio.get_running_loop().time()
            if left <= 0:
                return
            await asyncio.wait((self._flusher,), timeout=left)

    async def _flush(self) -> None:
        try:
            while self._pending:
                batch = self._pending[:MAX_BATCH]
                del self._pending[:MAX_BATCH]
                retry = await self._send(batch)
                if retry and await self._load_scripts(retry):
                    await self._send(retry, final=True)
        finally:
            self._flusher = None

    async def _send(
        self, batch: list[tuple[tuple[Any, ...], Waiter]], final: bool = False
    ) -> list[tuple[tuple[Any, ...], Waiter]]:
        """Send one pipeline; the entries Redis answered NOSCRIPT for come back for a retry."""
        live = [(cmd, w) for cmd, w in batch if not (isinstance(w, asyncio.Future) and w.done())]
        if not live:
            return []
        try:
            replies = await self._round_trip([cmd for cmd, _ in live])
        except STORE_FAILURES as exc:
            self._conns.stale()
            self._on_round_trip(exc)
            for _, w in live:
                _fail(w, exc)
            return []
        moved = next((r for r in replies if isinstance(r, _MOVED)), None)
        if moved is not None:
            self._conns.stale()
        self._on_round_trip(moved or next((r for r in replies if _refused(r)), None))
        retry = []
        for (cmd, w), reply in zip(live, replies, strict=True):
            if isinstance(reply, NoScriptError) and not final:
                retry.append((cmd, w))
            elif isinstance(w, asyncio.Future):
                if w.done():
                    continue
                if isinstance(reply, Exception):
                    w.set_exception(reply)
                else:
                    w.set_result(reply)
            elif isinstance(reply, Exception):
                w()
        return retry

    async def _round_trip(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        payload = b"".join([pack(cmd) for cmd in commands])
        async with asyncio.timeout(self._timeout):
            conn, release = await self._conns.get()
        try:
            async with asyncio.timeout(self._timeout):
                await conn.send_packed_command(payload, check_health=False)
                replies: list[Any] = []
                for _ in commands:
                    try:
                        replies.append(await conn.read_response())
                    except ResponseError as exc:  # this command's error; the rest still come
                        replies.append(exc)
        except BaseException:
            await conn.disconnect(nowait=True)  # replies may still be on the wire: unusable
            raise
        finally:
            await release()
        return replies

    async def _load_scripts(self, failed: list[tuple[tuple[Any, ...], Waiter]]) -> bool:
        # On the server the scripts will run on (a Cluster primary, the current master).
        loads = [("SCRIPT", "LOAD", self._scripts[sha]) for sha in {cmd[1] for cmd, _ in failed}]
        try:
            replies = await self._round_trip(loads)
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
        except STORE_FAILURES as exc:
            self._on_round_trip(exc)
            for _, w in failed:
                _fail(w, exc)
            return False
        return True


class HeldConnection(KeyConnections):
    """Standalone and Sentinel: the batcher has one pipeline on the wire at a time, so it keeps
    one connection rather than taking one from redis-py's pool per pipeline (that take and give
    back cost about a quarter of a round trip's CPU). A connection the batcher dropped after a
    failure reconnects on its next use. On Sentinel, one held to a former master is closed as
    soon as any user of the shared client has learnt the new master (`follow_master`), and
    reconnects to the new one: a promoted replica does not end connections to the old master,
    and a demoted one is only noticed at a write it refuses."""

    def __init__(self, client: Redis) -> None:
        super().__init__(client, "")
        self._pool = client.connection_pool
        self._sentinel = isinstance(self._pool, SentinelConnectionPool)
        self._conn: Connection | None = None

    async def get(self) -> tuple[Connection, Callable[[], Awaitable[None]]]:
        conn = self._conn
        if conn is None:
            return await self._first(), _keep
        if self._sentinel and off_master(self._client, conn):
            await conn.disconnect(nowait=True)
        if not conn.is_connected:
            # Its own connect: a Sentinel connection asks for the master there, while a write
            # on a closed connection (redis-py) would reconnect to the address it had.
            await conn.connect()
        return conn, _keep

    async def _first(self) -> Connection:
        conn: Connection = await self._pool.get_connection()
        self._conn = conn
        return conn

    def stale(self) -> None:
        pass

    async def drop(self) -> None:
        """Back to the pool, closed (it may point at a former master)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.disconnect(nowait=True)
            await self._pool.release(conn)


async def _keep() -> None:
    pass


def _fail(waiter: Waiter, exc: BaseException) -> None:
    if isinstance(waiter, asyncio.Future):
        if not waiter.done():
            waiter.set_exception(exc)
    else:
        waiter()
