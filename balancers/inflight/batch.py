"""Redis commands from concurrent requests, sent together: one pipeline in flight at a time.

A burst of 200 requests would otherwise queue for a handful of pooled connections, one round trip
each, and blow a timeout of tens of ms; pipelined, they cost a round trip or two between them.
Each command is still its own atomic unit (a script runs whole), and each caller still waits for
one round trip at most behind the batch on the wire.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoScriptError, RedisError

MAX_BATCH = 512


class Batcher:
    def __init__(
        self,
        redis: Redis,
        scripts: dict[str, str],
        timeout: float,
        on_round_trip: Callable[[bool], None],
    ) -> None:
        self._redis = redis
        self._on_round_trip = on_round_trip  # told whether each pipeline got its answer
        self._scripts = scripts  # sha -> source, reloaded when Redis answers NOSCRIPT
        self._timeout = timeout
        self._pending: list[tuple[tuple[Any, ...], asyncio.Future[Any]]] = []
        self._flusher: asyncio.Task[None] | None = None

    async def call(self, *command: Any) -> Any:
        """The command's reply; raises what Redis (or the wire) raised for it."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending.append((command, fut))
        if self._flusher is None:
            self._flusher = asyncio.get_running_loop().create_task(self._flush())
        return await fut

    async def _flush(self) -> None:
        try:
            while self._pending:
                batch = self._pending[:MAX_BATCH]
                del self._pending[:MAX_BATCH]
                retry = await self._send(batch)
                if retry:
                    await self._load_scripts(retry)
                    await self._send(retry, final=True)
        finally:
            self._flusher = None

    async def _send(
        self, batch: list[tuple[tuple[Any, ...], asyncio.Future[Any]]], final: bool = False
    ) -> list[tuple[tuple[Any, ...], asyncio.Future[Any]]]:
        """Send one pipeline; the entries Redis answered NOSCRIPT for come back for a retry."""
        live = [(cmd, fut) for cmd, fut in batch if not fut.done()]  # callers gone: skip
        if not live:
            return []
        try:
            async with (
                asyncio.timeout(self._timeout),
                self._redis.pipeline(transaction=False) as pipe,
            ):
                for cmd, _ in live:
                    pipe.execute_command(*cmd)
                replies = await pipe.execute(raise_on_error=False)
        except (RedisError, OSError, TimeoutError) as exc:
            self._on_round_trip(False)
            for _, fut in live:
                if not fut.done():
                    fut.set_exception(exc)
            return []
        self._on_round_trip(True)
        retry = []
        for (cmd, fut), reply in zip(live, replies, strict=True):
            if fut.done():
                continue
            if isinstance(reply, NoScriptError) and not final:
                retry.append((cmd, fut))
            elif isinstance(reply, Exception):
                fut.set_exception(reply)
            else:
                fut.set_result(reply)
        return retry

    async def _load_scripts(
        self, failed: list[tuple[tuple[Any, ...], asyncio.Future[Any]]]
    ) -> None:
        try:
            async with asyncio.timeout(self._timeout):
                for sha in {cmd[1] for cmd, _ in failed}:
                    await self._redis.script_load(self._scripts[sha])
        except (RedisError, OSError, TimeoutError) as exc:
            for _, fut in failed:
                if not fut.done():
                    fut.set_exception(exc)
