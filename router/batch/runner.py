"""The batch runner: takes lines of running jobs into the fleet's idle capacity, one replica of
many, and ends jobs (completed, cancelled, expired) with their output and error files.

Each tick (`batch.tick` s, a chore on the app's runner) it renews the leases of its lines in
flight, ends the jobs that are due, then decides how many lines may run: none while an
interactive request waits in admission's queue or every engine of the model shows a queue;
else `per_engine` for each engine whose fresh reading shows room (fewer than `room_waiting`
waiting, under `room_kv_usage` of its KV cache; an engine without a fresh reading counts as
room), at most `max_inflight`. Lines in flight finish; the next tick starts none when the
fleet fills, so batch work backs off within one scrape interval plus one tick.

A line runs through the router's own request path, in process: a request of the job's key is
handed to `Proxy.prepare` and run as the same ASGI response the HTTP face runs, in the
`sheddable` band, so picking, leases, retries, quotas and metrics apply. Its tpm is the key's,
in a window of its own (`<key>:batch`) sized to what the key's interactive traffic left unused
in its window: batch tokens are never in the interactive window, so they never push an
interactive request of the key into 429. Its usage is booked here, once, as `<key>:batch`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.requests import Request
from starlette.types import Message

from router.batch.files import Storage
from router.batch.store import ENDED, BatchStore
from router.core.backend import Backend
from router.core.endpoints import BY_ROUTE
from router.core.engine import EngineReading
from router.core.errors import STORE_FAILURES, Refused, answer
from router.core.fastjson import loads
from router.core.runner import Runner
from router.core.settings import BatchConfig
from router.request.admit.quota import KeyLimits
from router.request.lifecycle import account
from router.request.lifecycle.proxy import Proxy

log = logging.getLogger("sluicegate.batch")

MAX_SHOWN = 100  # jobs the console lists
MAX_ANSWER_BYTES = 8 * 1024 * 1024  # one line's answer held before it is written
RETRY_STATUSES = frozenset({429, 503})
# Redis or the volume failed under a line: its lease ends and any replica runs it again.
LINE_FAILURES: tuple[type[BaseException], ...] = (
    *STORE_FAILURES,
    OSError,
    ValueError,
    KeyError,
)  # no room after all: handed back, taken again later


class BatchKey(Protocol):
    """What a line needs of the job's client key (router/web/auth.py's `ClientKey`)."""

    @property
    def name(self) -> str | None: ...
    @property
    def models(self) -> frozenset[str] | None: ...
    @property
    def weight(self) -> float: ...
    @property
    def limits(self) -> KeyLimits | None: ...
    @property
    def owner(self) -> str: ...


@dataclass
class _Job:
    id: str
    owner: str
    total: int
    input_file: str
    model: str
    endpoint: str
    lines: set[int] = field(default_factory=set)  # this replica's lines in flight


def names(job_id: str) -> tuple[str, str]:
    """A job's copy of its input and its index of line offsets under the storage dir."""
    return f"{job_id}.input", f"{job_id}.idx"


class BatchRunner:
    def __init__(
        self,
        cfg: BatchConfig,
        store: BatchStore,
        storage: Storage,
        proxy: Proxy,
        key_of: Callable[[str], BatchKey | None] | None,
        runner: Runner,
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.storage = storage
        self.proxy = proxy
        self._key_of = key_of  # None: no client keys configured (every job anonymous)
        self.replica = os.urandom(6).hex()  # names this process's part files
        self._jobs: dict[str, _Job] = {}
        self._tasks: dict[asyncio.Task[None], float] = {}  # lines in flight -> when begun
        self._preempted: set[asyncio.Task[None]] = set()
        self._cooling: dict[str, float] = {}  # job -> monotonic time it may take lines again
        self.inflight = 0
        self._seen: list[dict[str, Any]] = []  # the jobs of the last tick, for the console
        runner.every("batch", self.tick, cfg.tick)

    def view(self) -> list[dict[str, Any]]:
        """The jobs not yet ended as the last tick read them (the console's Batch panel)."""
        return self._seen

    # --- the tick --------------------------------------------------------------------------

    async def tick(self) -> None:
        store, cfg = self.store, self.cfg
        for job in self._jobs.values():
            if job.lines:
                await store.renew(job.id, sorted(job.lines), cfg.lease_ttl)
        now = time.time()
        seen: list[dict[str, Any]] = []
        for job_id in await store.active():
            fields = await store.job(job_id)
            if fields is None:
                continue
            status = fields["status"]
            seen.append(
                {
                    "id": job_id,
                    "model": fields.get("model"),
                    "status": status,
                    "total": int(fields.get("total", 0)),
                    "completed": int(fields.get("completed", 0)),
                    "failed": int(fields.get("failed", 0)),
                }
            )
            if status in ENDED:
                self._jobs.pop(job_id, None)
                continue
            job = self._job(job_id, fields)
            if status == "in_progress" and now >= int(fields["expires_at"]):
                await self.end(job, "expired", {"code": "batch_expired", "message": _EXPIRED})
                continue
            if status == "cancelling":
                if not job.lines and await store.live(job_id) == 0:
                    await self.end(job, "cancelled", {"code": "batch_cancelled", "message": _CANC})
                continue
            if await store.ended_lines(job_id) >= job.total and await store.live(job_id) == 0:
                await self.end(job, "completed", None)
                continue
            await self._fill(job)
        self._seen = seen[:MAX_SHOWN]
        if cfg.preempt:
            self._preempt()
        proxy = self.proxy
        proxy.metrics.batch_inflight.set(self.inflight)
        counts: dict[str, int] = {}
        for row in seen:
            counts[row["status"]] = counts.get(row["status"], 0) + 1
        for status in ("validating", "in_progress", "finalizing", "cancelling"):
            proxy.metrics.batch_jobs.labels(status).set(counts.get(status, 0))

    def _job(self, job_id: str, fields: Mapping[str, str]) -> _Job:
        job = self._jobs.get(job_id)
        if job is None:
            job = self._jobs[job_id] = _Job(
                job_id,
                fields["owner"],
                int(fields["total"]),
                fields["input_file_id"],
                fields["model"],
                fields["endpoint"],
            )
        return job

    def room(self, model: str) -> int:
        """Lines that may be in flight now for `model` (`room`, from this process's view)."""
        proxy = self.proxy
        return room(
            self.cfg,
            proxy.registry.snapshot.by_model.get(model, ()),
            proxy.readings() if proxy.readings is not None else {},
            proxy.admission.depth if proxy.admission is not None else 0,
        )

    def _ended(self, task: asyncio.Task[None]) -> None:
        self._tasks.pop(task, None)
        self._preempted.discard(task)

    def _preempt(self) -> None:
        """`batch.preempt`: for each interactive request waiting in admission's queue, the
        youngest line in flight here is cancelled (handed back by `_line`, run again later)."""
        admission = self.proxy.admission
        waiting = admission.depth if admission is not None else 0
        if not waiting:
            return
        young = sorted(
            (t for t in self._tasks if t not in self._preempted),
            key=self._tasks.__getitem__,
            reverse=True,
        )
        for task in young[:waiting]:
            self._preempted.add(task)
            task.cancel()

    async def _fill(self, job: _Job) -> None:
        if self.proxy.lifecycle.draining or self._cooling.get(job.id, 0.0) > time.monotonic():
            return  # a draining router takes no new line: another replica will
        admission = self.proxy.admission
        if admission is not None and admission.depth:
            self.proxy.metrics.batch_yields.inc()  # requests wait for a slot: they go first
            return
        room = self.room(job.model) - self.inflight
        while room > 0:
            line = await self.store.take(job.id, job.total, self.cfg.lease_ttl)
            if line < 0:
                return
            room -= 1
            self.inflight += 1
            job.lines.add(line)
            task = asyncio.get_running_loop().create_task(self._line(job, line))
            self._tasks[task] = time.monotonic()
            task.add_done_callback(self._ended)

    # --- one line --------------------------------------------------------------------------

    async def _line(self, job: _Job, i: int) -> None:
        metrics = self.proxy.metrics
        try:
            src, idx = names(job.id)
            line = self.storage.line(src, idx, i, self.proxy.settings.max_body_bytes)
            key = None
            if self._key_of is not None:
                key = self._key_of(job.owner)
            status, body, request_id, used = await self._call(job, line, key)
            if status in RETRY_STATUSES:
                self._cooling[job.id] = time.monotonic() + self.cfg.tick * 4
                await self.store.release(job.id, i)
                metrics.batch_lines.labels("retried").inc()
                return
            row = {
                "id": f"batch_req_{os.urandom(12).hex()}",
                "custom_id": line["custom_id"],
                "response": {"status_code": status, "request_id": request_id, "body": body},
                "error": None,
            }
            ok = 200 <= status < 300
            part = f"{job.id}.{self.replica}.part"
            data = json.dumps(row, separators=(",", ":")).encode() + b"\n"
            await asyncio.to_thread(self.storage.append, part, data)
            ended = await self.store.finish(job.id, i, ok)
            if ended < 0:
                metrics.batch_lines.labels("duplicate").inc()
                return
            metrics.batch_lines.labels("completed" if ok else "failed").inc()
            if used is not None:
                self._book(job, key, used)
            if ended >= job.total:
                await self.end(job, "completed", None)
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if me is None or me not in self._preempted:
                raise
            # Preempted for an interactive request: handed back, its work counted as waste.
            metrics.batch_lines.labels("preempted").inc()
            await self.store.release(job.id, i)
        except LINE_FAILURES as exc:
            # Redis or the volume failed: the lease ends and any replica runs the line again.
            log.warning("batch line failed", extra={"fields": {"error": type(exc).__name__}})
        finally:
            job.lines.discard(i)
            self.inflight -= 1

    def _book(self, job: _Job, key: BatchKey | None, used: account.Tokens) -> None:
        label = ((key.name if key is not None else None) or "unnamed") + ":batch"
        prompt = round(used.prompt)
        self.proxy.usage.record(
            label, job.model, prompt, used.completion, used.cached, used.estimated
        )
        self.proxy.metrics.tokens(label, job.model, prompt, used.completion, used.cached)

    def _limits(self, key: BatchKey) -> KeyLimits | None:
        """The key's tpm left unused by its interactive traffic, as a window of its own."""
        limits = key.limits
        if limits is None or limits.tpm is None:
            return None
        _, tokens, _ = self.proxy.quotas.in_use(limits.key_id)
        left = max(1, math.floor((limits.tpm - tokens) * self.cfg.tpm_share))
        return KeyLimits(limits.key_id + ":batch", tpm=left, label=limits.label)

    async def _call(
        self, job: _Job, line: dict[str, Any], key: BatchKey | None
    ) -> tuple[int, Any, str, account.Tokens | None]:
        """One line through the request path: (status, answer body, request id, tokens)."""
        body = json.dumps(line["body"]).encode()
        request_id = os.urandom(16).hex()
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": job.endpoint,
            "raw_path": job.endpoint.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"x-request-id", request_id.encode()),
            ],
            "client": ("batch", 0),
            "server": ("batch", 0),
        }
        sent = False
        gone = asyncio.Event()  # never set: the in-process client never leaves

        async def receive() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        status = 0
        chunks: list[bytes] = []
        size = 0

        async def send(message: Message) -> None:
            nonlocal status, size
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                size += len(chunk)
                if size <= MAX_ANSWER_BYTES:
                    chunks.append(chunk)

        row = BY_ROUTE[("POST", job.endpoint)]
        used: account.Tokens | None = None
        try:
            call = await self.proxy.prepare(
                Request(scope, receive),
                row,
                key.models if key is not None else None,
                key.name if key is not None else None,
                "sheddable",
                key.weight if key is not None else 1.0,
                self._limits(key) if key is not None else None,
                None,
                key.owner if key is not None else job.owner,
            )
            call.call.record.batch = True
            await call(scope, receive, send)
            used = account.tokens(call.call)
        except Refused as refused:
            response = answer(refused)
            status, chunks = response.status_code, [bytes(response.body)]
        raw = b"".join(chunks)
        try:
            parsed: Any = loads(raw) if size <= MAX_ANSWER_BYTES else None
        except ValueError:
            parsed = raw.decode("utf-8", "replace")
        return status, parsed, request_id, used

    # --- the end of a job ------------------------------------------------------------------

    async def end(self, job: _Job, status: str, marked: dict[str, str] | None) -> None:
        """Write the job's output and error files (one replica, under a lock) and end it."""
        store = self.store
        if not await store.lock(job.id, self.replica, 300):
            return
        now = int(time.time())
        await store.set_fields(job.id, {"finalizing_at": str(now)})
        src, idx = names(job.id)
        out_bytes, err_bytes, outs, errs = await asyncio.to_thread(
            self.storage.write_results, job.id, src, idx, marked
        )
        fields = {"status": status, f"{status}_at": str(now)}
        for kind, size, n in (("output", out_bytes, outs), ("error", err_bytes, errs)):
            if n == 0:
                continue
            file_id = f"file-{os.urandom(12).hex()}"
            name = f"{job.id}.output" if kind == "output" else f"{job.id}.errors"
            target = f"{file_id}.jsonl"
            os.replace(self.storage.path(name), self.storage.path(target))
            await store.put_file(
                {
                    "id": file_id,
                    "object": "file",
                    "bytes": size,
                    "created_at": now,
                    "filename": f"batch_{job.id}_{kind}.jsonl",
                    "purpose": "batch_output",
                    "status": "processed",
                    "owner": job.owner,
                    "path": target,
                },
                job.owner,
            )
            fields[f"{kind}_file_id"] = file_id
        for leftover in (f"{job.id}.output", f"{job.id}.errors", src):
            self.storage.remove(leftover)
        await store.end(job.id, job.owner, fields)
        self._jobs.pop(job.id, None)

    async def aclose(self) -> None:
        """Lines in flight are stopped and handed back: any replica takes them again."""
        held = [(job.id, line) for job in self._jobs.values() for line in job.lines]
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        for job_id, line in held:
            try:
                await self.store.release(job_id, line)
            except STORE_FAILURES:
                pass


def room(
    cfg: BatchConfig,
    backends: Sequence[Backend],
    readings: Mapping[str, EngineReading],
    queued: int,
) -> int:
    """Lines that may be in flight: none while `queued` interactive requests wait in admission;
    else `per_engine` for each backend whose fresh reading shows room (one without a fresh
    reading counts as room), at most `max_inflight`."""
    if queued > 0:
        return 0
    free = sum(1 for b in backends if cfg.room_in(readings.get(b.name)))
    return min(cfg.max_inflight, free * cfg.per_engine)


_EXPIRED = "The batch expired before this request could be run."
_CANC = "The batch was cancelled before this request could be run."


def allowed(key: BatchKey | None, model: str) -> bool:
    models: Set[str] | None = key.models if key is not None else None
    return models is None or model in models
